"""The MoE rules of the HF mapping, at expert TP 1, 2 and 4 (etp > 1 runs on GPU only, so this is
its CPU check): the pieces an expert-TP rank reads, from the published per-expert tensors and from
transformers 5's fused 3D layout, equal megatron's shard of the fused full tensor; to_hf inverts
from_hf. The expert width differs from the dense MLP's, so a rule using the wrong one fails."""

from __future__ import annotations

import re

import pytest
import torch

from ftcore.hf import fused_experts, mappings
from ftcore.models.sharding import ShardInfo, take_shard
from tests.unit.hf.test_mappings import _read


def _shapes(family: str) -> mappings.Shapes:
    return mappings.Shapes(hidden=16, ffn=24, heads=4, groups=2, head_dim=4, vocab=37, layers=2,
                           tie=False, qk_norm=family == "qwen3_moe", experts=4, moe_ffn=12,
                           dense_layers=(1,) if family == "qwen3_moe" else (), family=family)  # fmt: skip


def _hf(s: mappings.Shapes) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(mappings.hf_shape(n, s), generator=g) for n in mappings.hf_names(s)}


def _fused(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same model in transformers 5's fused layout (what save_original_format=False writes)."""
    out, parts = {}, {}
    for n, t in hf.items():
        name, expert, part = fused_experts.fused_name(n)
        if part is None:
            out[name] = t
        else:
            parts.setdefault(name, {}).setdefault(expert, {})[part] = t
    for name, per in parts.items():
        key = "down" if name.endswith("down_proj") else None
        out[name] = torch.stack([per[e]["down"] if key else torch.cat([per[e]["gate"], per[e]["up"]])
                                 for e in sorted(per)])  # fmt: skip
    return out


def _read_any(t: dict, piece: mappings.Piece, like: torch.Tensor) -> torch.Tensor:
    if piece.expert is None:
        return _read(t, piece, like)
    return _read({piece.hf: t[piece.hf][piece.expert]}, piece, like)


CASES = [  # (global name, partition dim under expert TP)
    ("decoder.layers.0.mlp.router.weight", None),
    ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", 0),
    ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", 1),
]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("etp", [1, 2, 4])
@pytest.mark.parametrize("name,dim", CASES)
def test_expert_pieces_equal_megatron_shard(family, etp, name, dim):
    s = _shapes(family)
    hf = _hf(s)
    fused = _fused(hf)
    mp = mappings.resolve(name, s.tie, s)
    full = mappings.from_hf(mp, hf, s, 0)
    info = ShardInfo(name, tuple(full.shape), dim, mp.rule.kind in ("glu", "expert_glu"))
    for rank in range(etp):
        want = take_shard(full, info, rank, etp)
        pieces = mappings.shard_pieces(mp, info, s, rank, etp)
        assert torch.equal(torch.cat([_read(hf, p, full) for p in pieces]), want)
        fp = [fused_experts.fused_piece(p, s.moe_ffn) for p in pieces]
        assert torch.equal(torch.cat([_read_any(fused, p, full) for p in fp]), want)
    back = mappings.to_hf(mp, full, s)
    assert set(back) == set(mp.hf)
    for k, v in back.items():
        assert torch.equal(v, hf[k])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_names_per_family(family):
    s = _shapes(family)
    names = mappings.hf_names(s)
    experts = [n for n in names if ".experts." in n]
    assert len(experts) == 3 * 4 * (1 if family == "qwen3_moe" else 2)
    if family == "qwen3_moe":
        assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    else:
        assert all(re.search(r"block_sparse_moe\.experts\.\d\.w[123]\.weight$", n) for n in experts)
        assert "model.layers.1.block_sparse_moe.gate.weight" in names
    shapes = fused_experts.fused_shapes(names, s, mappings.hf_shape)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 24, 16)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (4, 16, 12)
