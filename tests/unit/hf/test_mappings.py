"""The declarative HF <-> megatron mapping: the pieces a TP rank reads equal megatron's shard of the
fused full tensor (ftcore.models.sharding.take_shard) for every kind, and to_hf inverts from_hf."""

from __future__ import annotations

import pytest
import torch

from ftcore.hf import mappings
from ftcore.models.sharding import ShardInfo, take_shard

# every family's tensors at once: q/k/v biases (Qwen2) and [head_dim] q/k norms (Qwen3), with a
# head dim apart from hidden / heads (8 x 6 = 48 != 16)
S = mappings.Shapes(hidden=16, ffn=24, heads=8, groups=4, head_dim=6, vocab=37, layers=2, tie=False,
                    qkv_bias=True, qk_norm=True)  # fmt: skip


def _hf_tensors(s: mappings.Shapes) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(mappings.hf_shape(n, s), generator=g) for n in mappings.hf_names(s)}


def _read(t: dict, piece: mappings.Piece, like: torch.Tensor) -> torch.Tensor:
    if piece.hf is None:
        return torch.zeros((piece.rows[1] - piece.rows[0],) + tuple(like.shape[1:]))
    x = t[piece.hf]
    if piece.rows:
        x = x[piece.rows[0] : piece.rows[1]]
    if piece.cols:
        x = x[:, piece.cols[0] : piece.cols[1]]
    return x


CASES = [  # (global name, partition dim under TP)
    ("embedding.word_embeddings.weight", 0),
    ("decoder.layers.1.input_layernorm.weight", None),
    ("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", None),
    ("decoder.layers.1.self_attention.linear_qkv.weight", 0),
    ("decoder.layers.1.self_attention.linear_qkv.bias", 0),
    ("decoder.layers.0.self_attention.q_layernorm.weight", None),
    ("decoder.layers.0.self_attention.k_layernorm.weight", None),
    ("decoder.layers.1.self_attention.linear_proj.weight", 1),
    ("decoder.layers.0.pre_mlp_layernorm.weight", None),
    ("decoder.layers.0.mlp.linear_fc1.weight", 0),
    ("decoder.layers.0.mlp.linear_fc2.weight", 1),
    ("decoder.final_layernorm.weight", None),
    ("output_layer.weight", 0),
]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name,dim", CASES)
def test_pieces_equal_megatron_shard(name, dim, tp):
    hf = _hf_tensors(S)
    padded = 128 * tp * ((S.vocab + 128 * tp - 1) // (128 * tp))
    mp = mappings.resolve(name, S.tie)
    full = mappings.from_hf(mp, hf, S, padded)
    info = ShardInfo(name, tuple(full.shape), dim, mp.rule.kind == "glu")
    for rank in range(tp):
        want = take_shard(full, info, rank, tp)
        pieces = mappings.shard_pieces(mp, info, S, rank, tp)
        got = torch.cat([_read(hf, p, full) for p in pieces])
        assert torch.equal(got, want), (name, tp, rank)
    back = mappings.to_hf(mp, full, S)
    assert set(back) == set(mp.hf)
    for k, v in back.items():
        assert torch.equal(v, hf[k])


def test_qkv_is_grouped_the_megatron_way():
    """Rows of linear_qkv: q heads of group 0, k of group 0, v of group 0, then group 1..."""
    hf = _hf_tensors(S)
    mp = mappings.resolve("decoder.layers.0.self_attention.linear_qkv.weight", False)
    full = mappings.from_hf(mp, hf, S, 0)
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    d, per = S.head_dim, S.heads // S.groups
    block = (per + 2) * d
    for g in range(S.groups):
        assert torch.equal(
            full[g * block : g * block + per * d], q[g * per * d : (g + 1) * per * d]
        )
        assert torch.equal(
            full[g * block + per * d : g * block + (per + 1) * d], k[g * d : (g + 1) * d]
        )
        assert torch.equal(
            full[g * block + (per + 1) * d : (g + 1) * block], v[g * d : (g + 1) * d]
        )


def test_tied_head_reads_the_embedding_and_unknown_names_are_none():
    assert mappings.resolve("output_layer.weight", True).hf == ("model.embed_tokens.weight",)
    assert mappings.resolve("output_layer.weight", False).hf == ("lm_head.weight",)
    assert (
        mappings.resolve("decoder.layers.0.self_attention.linear_qkv.lora_a.weight", False) is None
    )
    tied = mappings.Shapes(**{**S.__dict__, "tie": True})
    assert "lm_head.weight" not in mappings.hf_names(tied)
