"""Merging (peft/merge.py): scale·B·A folded into megatron's fused tensor is, mapped to Hugging
Face layout, scale·B·A per module; the HF-layout merge is W + scale·B·A."""

from __future__ import annotations

import pytest
import torch

from ftcore.hf import mappings
from ftcore.peft.adapter_format import to_peft
from ftcore.peft.config import Geometry
from ftcore.peft.merge import megatron_deltas, merge_deltas, merge_state
from tests.support.adapters import full_adapters

GEO = Geometry(hidden=8, ffn=12, heads=4, groups=2, head_dim=2)
SHAPES = mappings.Shapes(
    hidden=8, ffn=12, heads=4, groups=2, head_dim=2, vocab=16, layers=1, tie=False
)


@pytest.mark.parametrize("shared", [False, True])
def test_megatron_merge_equals_hf_merge(shared):
    """scale*B@A folded into the fused megatron tensor, mapped back to HF, is scale*B@A per module."""
    full, scale = full_adapters(GEO, shared), 1.5
    deltas = megatron_deltas(full, GEO, scale)
    sd, _ = to_peft(full)
    mp = mappings.resolve("decoder.layers.0.self_attention.linear_qkv.weight", False)
    hf = mappings.to_hf(mp, deltas["decoder.layers.0.self_attention.linear_qkv.weight"], SHAPES)
    for name, t in hf.items():
        s = name.split(".")[-2]
        a, b = (sd[f"base_model.model.model.layers.0.self_attn.{s}.lora_{x}.weight"] for x in "AB")
        torch.testing.assert_close(t, scale * b @ a)


def test_hf_merge_adds_scaled_BA_to_its_weight_only():
    sd, _ = to_peft(full_adapters(GEO, shared=False))
    deltas = merge_deltas({"r": 2, "lora_alpha": 3.0}, sd)  # scale 1.5
    w = {"model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, dtype=torch.bfloat16),
         "model.layers.0.self_attn.o_proj.weight": torch.randn(8, 8)}  # fmt: skip
    before = dict(w)
    merged = merge_state(dict(w), deltas)
    a = sd["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = sd["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert merged[q].dtype == torch.bfloat16
    torch.testing.assert_close(merged[q], (before[q].float() + 1.5 * b @ a).to(torch.bfloat16))
    o = "model.layers.0.self_attn.o_proj.weight"
    assert merged[o] is before[o]  # no adapter on o_proj: passed through
