"""The benchmark's what-if probes change speed, never the math: the loss of the same micro-batches
is the same with torch SDPA in place of megatron's local attention, and with unpacked micro-batches
cut to their longest row (packed rows too, for SDPA: the block-diagonal mask)."""

from __future__ import annotations

import copy

import pytest

from ftcore.config import compose


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    from ftcore import trainer
    from ftcore.runtime import dist

    cfg = compose([
        "+exp=tiny_full", "peft=lora", "data.seq_len=64", "data.packing=false",
        "train.global_batch_size=4", "train.micro_batch_size=4", "launcher.threads_per_rank=1",
        f"run.dir={tmp_path_factory.mktemp('run')}", "checkpoint.resume=never",
    ])  # fmt: skip
    st = trainer.setup(cfg)
    yield st
    dist.teardown()


def _loss(state, mbs):
    from ftcore import trainer

    s, n = trainer.run_batches(state, mbs, forward_only=True)
    return s / n


def test_trim_and_sdpa_keep_the_loss(state, monkeypatch):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from ftcore import bench_probes
    from ftcore.data.packing import make_microbatch

    mbs = state.loader.next_microbatches()
    docs = state.loader.docs.docs
    rows = [[], [], []]
    for d in docs:  # fill three rows of 64 with whole documents; a fourth row is all padding
        r = next((r for r in rows if sum(map(len, r)) + len(d) <= 64), None)
        if r is None:
            break
        r.append(d)
    assert max(len(r) for r in rows) > 1
    packed = [make_microbatch([*rows, []], 64, 0)]
    ref, ref_packed = _loss(state, mbs), _loss(state, packed)
    trimmed = [bench_probes._trim(copy.copy(mb)) for mb in mbs]
    assert trimmed[0].tokens.shape[1] < 64
    assert _loss(state, trimmed) == pytest.approx(ref, rel=1e-5)
    monkeypatch.setattr(DotProductAttention, "forward", bench_probes._sdpa_forward)
    assert _loss(state, mbs) == pytest.approx(ref, rel=1e-5)
    assert _loss(state, packed) == pytest.approx(ref_packed, rel=1e-5)
    assert _loss(state, trimmed) == pytest.approx(ref, rel=1e-5)


def test_contiguous_grad_probe_keeps_the_gradient(monkeypatch):
    import torch
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

    from ftcore import bench_probes

    w = torch.randn(64, 16)
    x = torch.randn(8, 2, 16, requires_grad=True)
    g = torch.randn(2, 8, 64).transpose(0, 1)  # the transposed view GPTModel's logits hand back

    def grad():
        x.grad = None
        LinearWithFrozenWeight.apply(x, w, None, False, None).backward(g)
        return x.grad.clone()

    ref = grad()
    monkeypatch.setattr(
        LinearWithFrozenWeight, "backward", staticmethod(bench_probes._frozen_backward_contiguous)
    )
    torch.testing.assert_close(grad(), ref, rtol=1e-5, atol=1e-6)
