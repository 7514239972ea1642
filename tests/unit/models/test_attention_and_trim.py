"""Speed-ups that must not change the math: torch SDPA as the local core attention (vs megatron's
own DotProductAttention path) and unpacked micro-batches cut to their longest row (vs padded to
seq_len): the same loss and the same LoRA gradients for the same documents."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ftcore.config.schema import compose


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    from ftcore.runtime import dist
    from ftcore.training import trainer

    cfg = compose([
        "+exp=tiny_full", "peft=lora", "model.allow_random_base=true", "data.seq_len=64",
        "data.packing=false",
        "train.global_batch_size=4", "train.micro_batch_size=2", "launcher.threads_per_rank=1",
        f"run.dir={tmp_path_factory.mktemp('run')}", "checkpoint.resume=never",
    ])  # fmt: skip
    st = trainer.setup(cfg)
    yield st
    dist.teardown()


def _loss_and_grads(state, mbs):
    from ftcore.training import trainer

    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()  # as train_step: after a step, .grad aliases the grad buffer
    s, n = trainer.run_batches(state, mbs, forward_only=False)
    grads = {
        name: p.main_grad.clone()
        for chunk in state.model
        for name, p in chunk.named_parameters()
        if p.requires_grad
    }
    return s / n, grads


def _close(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-5)
    assert a[1].keys() == b[1].keys() and len(a[1]) > 0
    for k in a[1]:
        torch.testing.assert_close(a[1][k], b[1][k], rtol=1e-4, atol=1e-6, msg=k)


@contextlib.contextmanager
def _nonzero_lora_b(state):
    """LoRA B drawn nonzero (it starts at zero, which zeroes every A gradient), restored after."""
    lora_b = [p for c in state.model for n, p in c.named_parameters() if "lora_B" in n]
    saved = [p.detach().clone() for p in lora_b]
    for p in lora_b:
        p.data.normal_(0.0, 0.05)
    try:
        yield
    finally:
        for p, p0 in zip(lora_b, saved):
            p.data.copy_(p0)


def test_trimmed_and_padded_microbatches_agree(state):
    from ftcore.data.packing import make_microbatch
    from ftcore.data.pipeline import row_width, trim_multiple

    loader = state.loader
    assert trim_multiple(state.cfg) == 1  # CPU: the longest row, not rounded
    rows = loader.next_rows()
    docs = [[loader.docs.docs[d] for d in r] for r in rows]
    trimmed = [
        make_microbatch(docs[i : i + 2], row_width(docs[i : i + 2], 64, 1), 0) for i in (0, 2)
    ]
    padded = [make_microbatch(docs[i : i + 2], 64, 0) for i in (0, 2)]
    widths = [mb.tokens.shape[1] for mb in trimmed]
    longest = [max(sum(map(len, r)) for r in docs[i : i + 2]) for i in (0, 2)]
    assert widths == longest and all(w < 64 for w in widths), widths
    _close(_loss_and_grads(state, trimmed), _loss_and_grads(state, padded))


def _packed(docs):
    """Two micro-batches: three rows of 64 filled with whole documents, a fourth all padding."""
    from ftcore.data.packing import make_microbatch

    rows = [[], [], []]
    for d in docs:
        r = next((r for r in rows if sum(map(len, r)) + len(d) <= 64), None)
        if r is None:
            break
        r.append(d)
    assert max(len(r) for r in rows) > 1
    return [make_microbatch(rows[:2], 64, 0), make_microbatch([rows[2], []], 64, 0)]


def test_sdpa_matches_megatrons_attention_padded_and_packed(state, monkeypatch):
    from ftcore.models.local.attention import SdpaAttention

    packed = _packed(state.loader.docs.docs)
    padded = state.loader.next_microbatches()
    used, per_doc = [], []
    monkeypatch.setattr(SdpaAttention, "_megatron_only", lambda self: used.append(1) or False)
    by_document = SdpaAttention._per_document
    monkeypatch.setattr(
        SdpaAttention, "_per_document", lambda self, *a: per_doc.append(1) or by_document(self, *a)
    )
    fast = [_loss_and_grads(state, mbs) for mbs in (padded, packed)]
    assert used, "the model's core attention is SdpaAttention"
    # packed rows (half the calls) attend per document, but in the last layer only the target
    # rows query (attention_at_rows; the megatron path below computes them all)
    layers = len(state.model[-1].module.decoder.layers)
    assert len(per_doc) == len(used) // 2 * (layers - 1) // layers
    monkeypatch.setattr(SdpaAttention, "_megatron_only", lambda self: True)
    slow = [_loss_and_grads(state, mbs) for mbs in (padded, packed)]
    for a, b in zip(fast, slow):
        _close(a, b)


@pytest.mark.parametrize(
    "overrides, multiple",
    [
        (["data.packing=true"], None),
        (["data.trim_padding=false"], None),
        (["cluster=h100"], 8),
        (["cluster=h100", "parallel.tp=2", "parallel.sp=true", "parallel.cp=3"], 24),
        (["cluster=h100", "precision=fp8_cs"], 128),
    ],
)
def test_trim_multiple_keeps_what_the_layout_splits_divisible(overrides, multiple):
    from ftcore.data.pipeline import trim_multiple

    cfg = compose(["+exp=tiny_full", "data.packing=false", *overrides])
    assert trim_multiple(cfg) == multiple


def test_contiguous_output_grad_keeps_the_input_gradient():
    """The CPU hook on the output layer hands megatron's frozen-weight linear a contiguous
    gradient instead of GPTModel's transposed view: the same input gradient."""
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

    from ftcore.runtime import cpu

    class Out(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = w

        def forward(self, x):
            return LinearWithFrozenWeight.apply(x, self.w, None, False, None), None

    torch.manual_seed(0)
    w, x = torch.randn(64, 16), torch.randn(8, 2, 16)
    g = torch.randn(2, 8, 64).transpose(0, 1)  # the transposed view GPTModel's logits hand back

    def input_grad(layer):
        xi = x.clone().requires_grad_()
        logits, _ = layer(xi)
        assert logits.shape == g.shape
        logits.backward(g)
        return xi.grad

    hooked = Out(w)
    cpu.contiguous_output_grad(hooked)
    torch.testing.assert_close(input_grad(hooked), input_grad(Out(w)), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(input_grad(Out(w)), g.contiguous() @ w, rtol=1e-5, atol=1e-6)


def test_logits_at_targets_only_match_every_position(state, monkeypatch):
    """models/target_logits.py: the last layer's attention output projection, its MLP and the
    output layer at the target positions only (the shapes prove it ran) give the loss and
    gradients of computing every position."""
    from ftcore.models import target_logits

    chunk = state.model[-1].module
    seen = {}
    hooks = [
        chunk.decoder.layers[-1].mlp.register_forward_hook(
            lambda m, a, o: seen.__setitem__("mlp", a[0].shape[:2])
        ),
        chunk.output_layer.register_forward_hook(
            lambda m, a, o: seen.__setitem__("logits", o[0].shape[:2])
        ),
        chunk.decoder.layers[-1].self_attention.linear_proj.register_forward_hook(
            lambda m, a, o: seen.__setitem__("attn_proj", a[0].shape[:2])
        ),
    ]
    packed = _packed(state.loader.docs.docs)
    padded = state.loader.next_microbatches()
    targets = int(padded[0].loss_mask.sum())
    assert 0 < targets < padded[0].loss_mask.numel()
    fast = [_loss_and_grads(state, mbs) for mbs in (padded, packed)]
    n = (int(packed[1].loss_mask.sum()), 1)
    assert seen == {"mlp": n, "logits": n, "attn_proj": n}
    monkeypatch.setattr(target_logits, "applies", lambda chunk: False)
    slow = [_loss_and_grads(state, mbs) for mbs in (padded, packed)]
    assert seen["mlp"] == seen["attn_proj"] == packed[1].tokens.shape[::-1]  # every position
    for h in hooks:
        h.remove()
    for a, b in zip(fast, slow):
        _close(a, b)


def test_target_rows_follow_megatrons_sequence_first_order():
    from ftcore.models import target_logits

    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1]])  # [b, s]
    rows = target_logits.rows_of(mask)
    assert rows.tolist() == [1, 2, 4, 7]  # flattened [s, b]: position * b + sample
    labels = torch.arange(8).reshape(2, 4)
    assert target_logits.at_rows(labels, rows).tolist() == [[4, 1, 2, 7]]
    assert target_logits.rows_of(torch.zeros(2, 4, dtype=torch.long)).tolist() == [0]


def test_documents_cover_every_position_once_in_length_buckets():
    from ftcore.models.local.attention import bucket_width, documents

    widths = {n: bucket_width(n, 16) for n in (2, 16, 17, 20, 24, 25, 33, 48, 49, 100, 128)}
    assert widths == {2: 16, 16: 16, 17: 24, 20: 24, 24: 24, 25: 32, 33: 48, 48: 48, 49: 64,
                      100: 128, 128: 128}  # fmt: skip
    seg = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 2, 2, 2, 3, 0, 0]])  # [b, s]
    d = documents(seg, min_width=2)  # flat position = pos * b + row; widths 2, 3, 6
    assert [t.tolist() for t in d.buckets] == [[[1, 3]], [[0, 2, 4], [5, 7, 9]],
                                               [[6, 8, 10, 12, 14, 6]]]  # fmt: skip
    assert [t.tolist() for t in d.kept] == [[0, 1], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4]]
    assert d.singles.tolist() == [11, 13, 15]  # one-token documents and padding
    placed = torch.cat([b.view(-1)[k] for b, k in zip(d.buckets, d.kept)] + [d.singles])
    assert placed[d.order].tolist() == list(range(16))


@pytest.mark.parametrize("buffers", [True, False], ids=["grad-buffers", "megatron-loops"])
def test_step_with_norm_is_megatrons_step(state, buffers, monkeypatch):
    """trainer.train_step computes the gradient norm once (to skip non-finite steps), then
    optim.step_with_norm clips by it and updates: the same parameters as megatron's step(), with
    a clip that bites; by whole DDP grad buffers (the CPU runtime here) or megatron's loops."""
    import copy

    from ftcore.runtime import cpu
    from ftcore.training import optim, trainer

    opt = state.optimizer
    assert opt.ftcore_grad_buffers is not None
    if not buffers:
        monkeypatch.setattr(opt, "ftcore_grad_buffers", None)
    inner = [o.optimizer for o in opt.chained_optimizers]
    params = [p for chunk in state.model for p in chunk.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    saved = [copy.deepcopy(i.state_dict()) for i in inner]
    for chunk in state.model:
        chunk.zero_grad_buffer()
    trainer.run_batches(state, state.loader.next_microbatches(), forward_only=False)
    grads = [p.main_grad.clone() for p in params]
    for o in opt.chained_optimizers:
        o.config.clip_grad = 1e-3  # far below the norm: every gradient is scaled
    for i in inner:
        for g in i.param_groups:
            g["lr"] = 1e-2

    def restart():
        for p, p0, g in zip(params, start, grads):
            p.data.copy_(p0)
            p.main_grad.copy_(g)
        for i, sd in zip(inner, saved):
            i.load_state_dict(copy.deepcopy(sd))
            for g in i.param_groups:
                g["lr"] = 1e-2

    with cpu.device_mode():  # megatron's optimizer makes its tensors on "cuda"
        ok, norm_ref, _ = opt.step()
        ref = [p.detach().clone() for p in params]
        restart()
        assert not opt.prepare_grads()
        norm = optim.grad_norm(opt)
        assert optim.step_with_norm(opt, norm)
    assert ok and norm == pytest.approx(float(norm_ref), rel=1e-6) and norm > 1e-2
    moved = max(float((a - b).abs().max()) for a, b in zip(ref, start))
    assert moved > 1e-4
    for a, b in zip(params, ref):
        torch.testing.assert_close(a.detach(), b, rtol=1e-6, atol=1e-7)


def test_cpu_rope_is_megatrons_rotation(state, monkeypatch):
    """models/rope.apply_rope (installed as megatron's fused RoPE on CPU) == megatron's unfused
    rotation: alone in float64 with a gradcheck, and in the model (same loss and gradients)."""
    from megatron.core.models.common.embeddings import rope_utils

    from ftcore.models import rope

    assert state.model[0].config.apply_rope_fusion
    assert rope_utils.fused_apply_rotary_pos_emb is rope.apply_rope
    torch.manual_seed(0)
    half = torch.randn(12, 1, 1, 4, dtype=torch.float64)
    for freqs in (torch.cat([half, half], -1), torch.randn(12, 1, 1, 8, dtype=torch.float64)):
        t = torch.randn(12, 2, 3, 8, dtype=torch.float64, requires_grad=True)
        g = torch.randn(12, 2, 3, 8, dtype=torch.float64)
        want = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
        got = rope.apply_rope(t, freqs)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(
            torch.autograd.grad(got, t, g)[0],
            torch.autograd.grad(want, t, g)[0],
            rtol=0,
            atol=1e-12,
        )
        assert torch.autograd.gradcheck(lambda x, f=freqs: rope.apply_rope(x, f), (t,))

    mbs = state.loader.next_microbatches()
    unfused = lambda t, freqs, interleaved=False: rope_utils._apply_rotary_pos_emb_bshd(t, freqs)  # noqa: E731
    with _nonzero_lora_b(state):  # every adapter gradient then depends on the rotation's backward
        fast = _loss_and_grads(state, mbs)
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", unfused)
        slow = _loss_and_grads(state, mbs)
    assert all(float(g.abs().max()) > 0 for g in fast[1].values())
    _close(fast, slow)


def test_fused_lora_linear_is_megatrons_linear_plus_adapters(state, monkeypatch):
    """On the CPU runtime at TP 1 each LoRA linear runs as one autograd function with its frozen
    base (peft/fused.py): the same loss and adapter gradients as megatron's
    ColumnParallelLinear/RowParallelLinear plus the adapters' own autograd path (nonzero B, so A's
    gradients count too), and every adapted linear took the fused path."""
    from ftcore.peft import fused
    from ftcore.peft.layers import LoraParallelLinear, add_column

    mbs = state.loader.next_microbatches()
    calls = []
    fused_linear = fused.lora_linear
    monkeypatch.setattr(fused, "lora_linear", lambda *a: calls.append(1) or fused_linear(*a))

    def unfused(self, x):
        out, bias = self.base_layer(x)
        if self.column:
            return add_column(out, self.module, self.column_deltas(x), self.geo, self.tp), bias
        return out + self.lora_delta(x), bias

    with _nonzero_lora_b(state):
        fast = _loss_and_grads(state, mbs)
        n_fast = len(calls)
        monkeypatch.setattr(LoraParallelLinear, "forward", unfused)
        slow = _loss_and_grads(state, mbs)
    n_linears = sum(isinstance(m, LoraParallelLinear) for c in state.model for m in c.modules())
    assert n_fast >= n_linears > 0 and len(calls) == n_fast, "fused path taken, then not"
    _close(fast, slow)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_rmsnorm_function_is_the_autograd_formula(dtype):
    """The norm's closed-form backward (models/norm.py) == autograd through x r w, for x and a
    trained weight; gradcheck in float64; bf16 in, bf16 out, fp32 inside (float64 stays float64)."""
    from types import SimpleNamespace

    from ftcore.models.local.norm import RMSNorm

    cfg = SimpleNamespace(params_dtype=dtype, sequence_parallel=False)
    norm = RMSNorm(cfg, 16, eps=1e-5)
    norm.weight.data.normal_(1.0, 0.3)
    x = torch.randn(5, 3, 16, dtype=dtype).mul_(2.0).requires_grad_()
    g = torch.randn(5, 3, 16, dtype=dtype)

    def formula(x, w):
        ct = torch.promote_types(dtype, torch.float32)
        x32 = x.to(ct)
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * w.to(ct)).to(dtype)

    got, want = norm(x), formula(x, norm.weight)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    assert got.dtype == dtype
    for a, b in zip(torch.autograd.grad(got, (x, norm.weight), g),
                    torch.autograd.grad(want, (x, norm.weight), g)):  # fmt: skip
        torch.testing.assert_close(a, b, **tol)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda x, w: norm.forward.__func__(
            SimpleNamespace(weight=w, eps=1e-5), x), (x, norm.weight))  # fmt: skip


def test_swiglu_function_is_megatrons_glu(state, monkeypatch):
    """models/swiglu.py: silu(gate) * up with each half's gradient written into one tensor ==
    autograd through megatron's glu (float64, gradcheck), and the model's MLPs run it on CPU."""
    from ftcore.models.local import swiglu

    x = torch.randn(3, 2, 10, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 2, 5, dtype=torch.float64)
    gate, up = torch.chunk(x, 2, dim=-1)
    want = torch.nn.functional.silu(gate) * (up + 0.0)
    got = swiglu.swiglu(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0],
                               rtol=1e-15, atol=1e-15)  # fmt: skip
    assert torch.autograd.gradcheck(swiglu.swiglu, (x,))

    calls = []
    monkeypatch.setattr(
        swiglu, "swiglu", lambda t: calls.append(t.shape) or swiglu._SwiGLU.apply(t)
    )
    assert all(chunk.config.bias_activation_fusion for chunk in state.model)
    _loss_and_grads(state, state.loader.next_microbatches())
    layers = sum(len(chunk.module.decoder.layers) for chunk in state.model)
    assert len(calls) >= layers > 0
