"""What keeps a GPU step free of host syncs, checked on CPU (issue 24, finding 6): cu_seqlens built
once per micro-batch by array operations, pinned host batches and non-blocking copies for a CUDA
device, fused RoPE in the GPU TransformerConfig (megatron's real one), one loss read per step.
The syncs themselves are counted on a GPU by tests/gpu/test_host_sync.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ftcore.config.schema import compose
from ftcore.data import pipeline, transfer
from ftcore.data.packing import MicroBatch, cu_seqlens_from_segments, make_microbatch, pack
from ftcore.data.templates import Doc
from tests.support.tiny import TINY


def loop_cu_seqlens(segment_ids: torch.Tensor) -> tuple[list[int], int]:
    """The definition: runs of equal segment ids per row (padding is one more run), flattened."""
    lengths = []
    for row in segment_ids.tolist():
        runs, prev = [], None
        for s in row:
            if s == prev:
                runs[-1] += 1
            else:
                runs.append(1)
                prev = s
        lengths += runs
    return np.concatenate([[0], np.cumsum(lengths)]).tolist(), max(lengths, default=0)


def random_microbatch(rng: np.random.Generator) -> MicroBatch:
    """Packed rows of random documents (FFD / most-documents-first, ftcore's packer), some rows
    full, some with padding, some empty, some one-token documents."""
    seq = int(rng.integers(4, 64))
    lengths = [int(n) for n in rng.integers(1, seq + 1, size=int(rng.integers(1, 12)))]
    docs = [Doc(rng.integers(0, 50, n).astype(np.int32), rng.random(n) < 0.7) for n in lengths]
    rows = [[docs[i] for i in b] for b in pack(lengths, seq)]
    rows += [[] for _ in range(int(rng.integers(0, 2)))]  # an all-padding row
    rng.shuffle(rows)
    return make_microbatch(rows, seq, pad_id=0)


@pytest.mark.parametrize("seed", range(200))
def test_microbatch_carries_cu_seqlens_of_its_rows(seed):
    mb = random_microbatch(np.random.default_rng(seed))
    cu, longest = loop_cu_seqlens(mb.segment_ids)
    assert mb.cu_seqlens.dtype == torch.int32
    assert mb.cu_seqlens.tolist() == cu and mb.max_seqlen == longest
    assert isinstance(mb.max_seqlen, int)  # a Python int: PackedSeqParams reads no tensor


def test_cu_seqlens_edge_cases():
    for seg in ([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]], [[0, 0, 0]], [[1]], [[1, 2, 3, 0]]):
        t = torch.tensor(seg, dtype=torch.int32)
        cu, longest = cu_seqlens_from_segments(t)
        assert (cu.tolist(), longest) == loop_cu_seqlens(t) and cu.dtype == torch.int32
    cu, longest = cu_seqlens_from_segments(torch.zeros(0, 8, dtype=torch.int32))
    assert cu.tolist() == [0] and longest == 0


def test_packed_seq_params_reuse_the_microbatch_cu_seqlens(monkeypatch):
    """The forward step of each virtual stage reads the micro-batch's cu_seqlens; it never
    recomputes them from the segment ids."""
    from ftcore.data import packing
    from ftcore.training import step

    mb = random_microbatch(np.random.default_rng(0))

    def refuse(*_):
        raise AssertionError("cu_seqlens recomputed in the forward step")

    monkeypatch.setattr(packing, "cu_seqlens_from_segments", refuse)
    monkeypatch.setattr(step, "cu_seqlens_from_segments", refuse, raising=False)
    p = step.packed_seq_params(mb, torch.device("cpu"))
    assert p.cu_seqlens_q is mb.cu_seqlens and p.cu_seqlens_kv is mb.cu_seqlens
    assert p.max_seqlen_q == p.max_seqlen_kv == mb.max_seqlen and p.qkv_format == "thd"


def test_pin_decision(monkeypatch):
    """Pinned host batches for a CUDA device only, and only where CUDA is there (pin_memory()
    raises without it: a GPU config is validated and planned on CPU machines)."""
    assert not transfer.pin_host_batches("cpu")
    assert transfer.pin_host_batches("cuda") == torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert transfer.pin_host_batches("cuda") and transfer.pin_host_batches(torch.device("cuda", 1))
    assert not transfer.pin_host_batches("cpu")


class RecordTo(TorchFunctionMode):
    """Records each Tensor.to call; for a CUDA target it stands in for the copy (no CUDA here)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            self.calls.append((torch.device(args[1]).type, kwargs.get("non_blocking", False)))
            if torch.device(args[1]).type == "cuda":
                return args[0]
        return func(*args, **kwargs)


def test_copies_to_cuda_are_non_blocking():
    t = torch.arange(6)
    with RecordTo() as rec:
        transfer.to_device(t, torch.device("cuda", 0))
        transfer.to_device(t, "cuda")
        assert transfer.to_device(t, torch.device("cpu")) is t
    assert rec.calls == [("cuda", True), ("cuda", True), ("cpu", False)]


def _next_microbatches(device: str) -> list[MicroBatch]:
    """A training step's micro-batches from ftcore's loader, for a run on `device`."""
    cfg = compose(TINY + [f"cluster.device={device}", "data.packing=true",
                          "train.micro_batch_size=1", "train.global_batch_size=2"])  # fmt: skip
    rng = np.random.default_rng(0)
    docs = [Doc(rng.integers(0, 50, n).astype(np.int32), np.ones(n, bool)) for n in (5, 29, 30, 31)]
    source = pipeline.Docs(docs=docs, source_ids=[np.arange(len(docs))])
    return pipeline.TrainLoader(cfg, source, [len(docs)], 0, 0, 1).next_microbatches()


def test_training_batches_pinned_for_cuda(monkeypatch):
    pinned = []

    def pin(mb):  # CUDA is absent here: record the request instead of pinning
        pinned.append(mb)
        return mb

    monkeypatch.setattr(MicroBatch, "pin_memory", pin)
    assert len(_next_microbatches("cpu")) == 2 and not pinned
    assert len(_next_microbatches("cuda")) == 2 and not pinned  # no CUDA here: nothing pinned
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    mbs = _next_microbatches("cuda")
    assert pinned == mbs and len(mbs) == 2
    _next_microbatches("cpu")
    assert len(pinned) == 2  # a CPU run never pins


def test_gpu_transformer_config_fuses_rope(monkeypatch):
    """cluster.device=cuda builds megatron's real TransformerConfig with apply_rope_fusion on (its
    __post_init__ checks a kernel is there); with Transformer Engine's kernel present (a stand-in:
    TE is not installable here) that kernel is kept, not replaced by ftcore's CPU one."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import TransformerConfig

    from ftcore.models import rope
    from ftcore.models.llama import transformer_config

    for packing in ("false", "true"):
        cfg = compose(TINY + ["cluster.device=cuda", f"data.packing={packing}",
                              "train.micro_batch_size=1"])  # fmt: skip
        config = transformer_config(cfg, on_cpu=False)
        assert isinstance(config, TransformerConfig) and config.apply_rope_fusion
        assert not config.rotary_interleaved and not config.multi_latent_attention

    def te_kernel(t, freqs, interleaved=False):
        return t

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", te_kernel)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", te_kernel)
    assert transformer_config(
        compose(TINY + ["cluster.device=cuda"]), on_cpu=False
    ).apply_rope_fusion
    assert rope_utils.fused_apply_rotary_pos_emb is te_kernel
    assert not rope.use_fused_rope(on_cpu=True)  # on CPU a TE kernel is never used


def test_loss_read_once_and_unchanged():
    """The step's loss and token sums: one read of all micro-batch outputs, the same numbers as
    summing each output's floats on the host (what the trainer did per micro-batch)."""
    from ftcore.training.step import loss_sums

    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 17):
        out = [{"lm": torch.stack([torch.rand((), generator=g) * 100, torch.tensor(37.0)])}
               for _ in range(n)]  # fmt: skip
        old = [sum(float(o["lm"][0]) for o in out), sum(float(o["lm"][1]) for o in out)]
        assert loss_sums(out) == old
    assert loss_sums([]) == [0.0, 0.0]  # a stage without the loss


@pytest.mark.parametrize("seed", range(30))
def test_target_rows_width_from_the_host_mask(seed):
    """The last layer's attention at the target rows lays them out in a grid as wide as the most
    targets of one sequence: counted on the host loss mask (no device read), the same number as
    the device count it replaces, and the same attention output."""
    from ftcore.data.packing import attention_mask_from_segments
    from ftcore.models import target_logits
    from ftcore.models.local.attention import attention_at_rows

    rng = np.random.default_rng(seed)
    b, s = int(rng.integers(1, 5)), int(rng.integers(2, 24))
    density = 0.0 if seed == 0 else rng.random()  # seed 0: no targets at all
    loss_mask = torch.from_numpy((rng.random((b, s)) < density).astype(np.float32))
    rows = target_logits.rows_of(loss_mask)
    width = target_logits.widest(loss_mask)
    assert width == int(torch.bincount(rows % b, minlength=b).max())
    if 2 * rows.numel() > s * b:
        return  # attention then computes every row; the grid is not used
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, b, 2, 4, generator=g, dtype=torch.float64) for _ in "qkv")
    mask = attention_mask_from_segments(torch.ones(b, s, dtype=torch.int32))
    assert torch.equal(
        attention_at_rows(q, k, v, mask, rows, 0.5, width),
        attention_at_rows(q, k, v, mask, rows, 0.5),
    )


# aten ops whose output size depends on tensor values, or that read a value: on CUDA each waits
# for the GPU (torch.bincount did, per micro-batch, on an H200: docs/gpu/)
DEVICE_READS = ("bincount", "nonzero", "unique", "masked_select", "_local_scalar_dense", "item")


class RecordReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if any(name.startswith(r) for r in DEVICE_READS):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("seed", range(1, 6))
def test_target_rows_attention_reads_no_device_value(seed):
    """Given its width (the host count), the last layer's target-row attention runs no op that
    reads the device: the CPU stand-in for the GPU's sync count."""
    from ftcore.models import target_logits
    from ftcore.models.local.attention import attention_at_rows

    rng = np.random.default_rng(seed)
    b, s = 3, 16
    loss_mask = torch.from_numpy((rng.random((b, s)) < 0.3).astype(np.float32))
    rows, width = target_logits.rows_of(loss_mask), target_logits.widest(loss_mask)
    q, k, v = (torch.randn(s, b, 2, 4) for _ in "qkv")
    mask = torch.zeros(1, 1, s, s, dtype=torch.bool)
    with RecordReads() as rec:
        attention_at_rows(q, k, v, mask, rows, 0.5, width)
    assert rec.reads == []


def te_pad_between_seqs(cu, cu_padded) -> bool:
    """Transformer Engine 2.9's own decision when `pad_between_seqs` is left None (transcribed
    from DotProductAttention.forward, qkv_format "thd"; TE runs it on the device tensors, a host
    sync in every attention layer): the padded starts differ from the real ones."""
    return cu_padded is not None and not torch.equal(cu_padded[:-1], cu[:-1])


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_params_carry_pad_between_seqs(cp):
    """Issue 41 item 8: the THD parameters carry TE's pad_between_seqs, decided on the host."""
    from ftcore.models.thd import ThdParams
    from ftcore.training.step import packed_seq_params

    rng = np.random.default_rng(cp)
    seen = set()
    for _ in range(20):
        seq = 8 * int(rng.integers(2, 9))
        lengths = [int(n) for n in rng.integers(1, seq // 2, size=int(rng.integers(1, 6)))]
        docs = [Doc(rng.integers(0, 50, n).astype(np.int32), np.ones(n, bool)) for n in lengths]
        rows = [[docs[i] for i in b] for b in pack([-(-n // 8) * 8 for n in lengths], seq)]
        mb = make_microbatch(rows, seq, 0, 2 * cp if cp > 1 else 1)
        with RecordTo():
            p = packed_seq_params(mb, torch.device("cuda", 0))
        assert isinstance(p, ThdParams) and type(p.pad_between_seqs) is bool
        assert p.pad_between_seqs == te_pad_between_seqs(mb.cu_seqlens, mb.cu_seqlens_padded)
        seen.add(p.pad_between_seqs)
    assert seen == {False} if cp == 1 else True in seen


def test_te_attention_receives_pad_between_seqs():
    """The TE spec's core attention forwards the field to TE. A stand-in for megatron's
    TEDotProductAttention with its contract (TE is not installable here): it keeps the field
    names of megatron's PackedSeqParams and passes those of the given parameters to TE."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    from ftcore.models.thd import ThdParams, forwarding_pad_between_seqs

    class MegatronTEAttention:
        def __init__(self):
            self.kept_packed_seq_params = {f.name for f in dataclasses.fields(PackedSeqParams)}

        def forward(self, q, packed_seq_params=None):
            return {k: getattr(packed_seq_params, k) for k in self.kept_packed_seq_params}

    attn = forwarding_pad_between_seqs(MegatronTEAttention)()
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    got = attn.forward(None, packed_seq_params=ThdParams(cu_seqlens_q=cu, pad_between_seqs=True))
    assert got["pad_between_seqs"] is True and got["cu_seqlens_q"] is cu
    plain = attn.forward(None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    assert plain["pad_between_seqs"] is None  # TE decides, as before


def test_cp_slices_pinned_for_cuda(monkeypatch):
    """Issue 41 item 8: a CUDA run's CP slices (data/cp.py) are pinned like the host batch, so
    their non-blocking copies are asynchronous; never on a CPU run."""
    from ftcore.training.step import local_batch

    pinned = []

    def pin(t):  # no CUDA here: record the request instead of pinning
        pinned.append(t)
        return t

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    mb = _next_microbatches("cpu")[0]
    local_batch(mb, 2, 0, torch.device("cpu"))
    local_batch(mb, 2, 0, torch.device("cuda", 0))  # no CUDA: nothing pinned
    assert not pinned
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    part = local_batch(mb, 2, 1, torch.device("cuda", 0))
    assert len(pinned) == 5 and all(any(t is p for p in pinned) for t in
                                    (part.tokens, part.labels, part.loss_mask, part.position_ids,
                                     part.segment_ids))  # fmt: skip
    assert local_batch(mb, 1, 0, torch.device("cuda", 0)) is mb  # cp=1: the batch as pinned
