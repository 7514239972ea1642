"""LoRA adapters to test with: full (gathered) tensors under ftcore's names, PEFT adapter
directories for a given base shape, and the check that a trained adapter changed the model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
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


def trained_and_logged(log: str, adapter: Path) -> None:
    """Every step line's lr is the one its update applied, and the adapter changes the model.
    Adam's first update moves each weight by the lr (m/sqrt(v) = sign(g)), so after the quick
    start's one step every lora_B (zero at the start) holds values of exactly that size: the
    logged lr is the applied one. PEFT's model then gives other logits than the base."""
    from peft import AutoPeftModelForCausalLM
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    steps = re.findall(r"step (\d+)/(\d+) \|.*\| lr ([0-9.e+-]+) \|", log)
    assert steps and steps[0][:2] == ("1", "1"), log[-3000:]  # 40 records, train.epochs=1: 1 step
    lr = float(steps[0][2])
    lora_b = [
        t for k, t in load_file(adapter / "adapter_model.safetensors").items() if "lora_B" in k
    ]
    assert lora_b and lr > 0
    for t in lora_b:
        assert float(t.abs().max()) == pytest.approx(lr, rel=1e-2), (float(t.abs().max()), lr)
    peft = AutoPeftModelForCausalLM.from_pretrained(str(adapter)).eval()
    base = AutoModelForCausalLM.from_pretrained(
        peft.peft_config["default"].base_model_name_or_path
    ).eval()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        diff = (peft(input_ids=ids).logits - base(input_ids=ids).logits).abs().max()
    assert diff > 1e-3, diff
