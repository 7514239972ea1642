"""The slice adapters' fused layouts (peft/layers.py): per-slice deltas put into megatron's fused
linear_qkv / linear_fc1 output, checked against the Hugging Face mapping on each TP rank, and the
in-place path LoraParallelLinear takes against plain addition. No model is built here
(tests/multiproc does that)."""

from __future__ import annotations

import pytest
import torch

from ftcore.hf import mappings
from ftcore.models.sharding import ShardInfo, take_shard
from ftcore.peft.config import Geometry
from ftcore.peft.layers import add_column, fuse_column

GEO = Geometry(hidden=8, ffn=12, heads=4, groups=2, head_dim=2)
SHAPES = mappings.Shapes(
    hidden=8, ffn=12, heads=4, groups=2, head_dim=2, vocab=16, layers=1, tie=False
)


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_qkv_layout_matches_hf_mapping(tp):
    """Per-slice deltas put into the fused layout on each TP rank == the HF->megatron qkv mapping
    of those deltas, sharded the way megatron shards linear_qkv."""
    d = {s: torch.randn(GEO.out_in(s)[0], 8) for s in ("q_proj", "k_proj", "v_proj")}
    mp = mappings.resolve("decoder.layers.0.self_attention.linear_qkv.weight", False)
    full = mappings.from_hf(mp, {h: d[h.split(".")[-2]] for h in mp.hf}, SHAPES, 16)
    info = ShardInfo("x", tuple(full.shape), 0, False)
    for rank in range(tp):
        local = {
            s: t.chunk(tp, 0)[rank].t() for s, t in d.items()
        }  # [in, out/tp]: last dim = output
        got = fuse_column("linear_qkv", local, GEO, tp).t()
        assert torch.equal(got, take_shard(full, info, rank, tp))


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_fc1_layout_matches_hf_mapping(tp):
    d = {s: torch.randn(12, 8) for s in ("gate_proj", "up_proj")}
    mp = mappings.resolve("decoder.layers.0.mlp.linear_fc1.weight", False)
    full = mappings.from_hf(mp, {h: d[h.split(".")[-2]] for h in mp.hf}, SHAPES, 16)
    info = ShardInfo("decoder.layers.0.mlp.linear_fc1.weight", tuple(full.shape), 0, True)
    for rank in range(tp):
        local = {s: t.chunk(tp, 0)[rank].t() for s, t in d.items()}
        got = fuse_column("linear_fc1", local, GEO, tp).t()
        assert torch.equal(got, take_shard(full, info, rank, tp))


def test_missing_slices_are_zero():
    got = fuse_column(
        "linear_qkv", {"v_proj": torch.ones(3, 4)}, GEO, 1
    )  # [.., 2 groups x (4+2+2)]
    assert got.shape == (3, 16)
    assert got.view(3, 2, 8)[..., 6:].eq(1).all() and got.view(3, 2, 8)[..., :6].eq(0).all()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    "module, slices",
    [
        ("linear_qkv", ("q_proj", "k_proj", "v_proj")),
        ("linear_qkv", ("k_proj",)),
        ("linear_fc1", ("gate_proj", "up_proj")),
        ("linear_fc1", ("up_proj",)),
    ],
)
def test_add_column_equals_adding_the_fused_deltas(module, slices, tp):
    """The in-place path LoraParallelLinear takes == base + fuse_column(deltas): output and the
    gradients reaching the base output and every delta (float64, exact up to addition order)."""
    width = {"linear_qkv": 16, "linear_fc1": 24}[module] // tp
    cols = {s: GEO.out_in(s)[0] // tp for s in slices}
    base = torch.randn(3, 2, width, dtype=torch.float64, requires_grad=True)
    deltas = {
        s: torch.randn(3, 2, n, dtype=torch.float64, requires_grad=True) for s, n in cols.items()
    }
    grad = torch.randn(3, 2, width, dtype=torch.float64)

    want = base + fuse_column(module, deltas, GEO, tp)
    want_grads = torch.autograd.grad(want, [base, *deltas.values()], grad)
    got = add_column(base * 1.0, module, deltas, GEO, tp)  # a fresh tensor, as the base returns
    got_grads = torch.autograd.grad(got, [base, *deltas.values()], grad)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
