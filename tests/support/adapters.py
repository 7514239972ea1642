"""LoRA adapters to test with: full (gathered) tensors under ftcore's names, and PEFT adapter
directories for a given base shape."""

from __future__ import annotations

from pathlib import Path

import torch

from ftcore.peft.adapter_format import save_adapter
from ftcore.peft.config import HF_PARENT, Geometry, LoraSettings


def full_adapters(geo: Geometry, shared: bool, r: int = 2) -> dict[str, torch.Tensor]:
    """Layer 0's adapters on q, k, v (A shared when `shared`: megatron target names) and down,
    by global name, as gather_full returns them."""
    pre = "decoder.layers.0."
    out = {}
    if shared:
        out[pre + "self_attention.linear_qkv.lora_A.linear_qkv"] = torch.randn(r, geo.hidden)
    for s in ("q_proj", "k_proj", "v_proj"):
        if not shared:
            out[pre + f"self_attention.linear_qkv.lora_A.{s}"] = torch.randn(r, geo.hidden)
        out[pre + f"self_attention.linear_qkv.lora_B.{s}"] = torch.randn(geo.out_in(s)[0], r)
    out[pre + "mlp.linear_fc2.lora_A.down_proj"] = torch.randn(r, geo.ffn)
    out[pre + "mlp.linear_fc2.lora_B.down_proj"] = torch.randn(geo.hidden, r)
    return out


def adapter_dir(path: Path, targets, r: int = 4, hidden: int = 64, layers: int = 4) -> Path:
    """A zero PEFT adapter on `targets` of a `layers`-layer base of width `hidden`."""
    g = Geometry(hidden, 128, 4, 2, hidden // 4)
    sd = {}
    for i in range(layers):
        for s in targets:
            o, n = g.out_in(s)
            key = f"base_model.model.model.layers.{i}.{HF_PARENT[s]}.{s}"
            sd[f"{key}.lora_A.weight"] = torch.zeros(r, n)
            sd[f"{key}.lora_B.weight"] = torch.zeros(o, r)
    save_adapter(path, sd, LoraSettings(r, 8.0, 0.0, tuple(targets), False), list(targets), None)
    return path
