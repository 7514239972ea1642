"""The Hugging Face PEFT adapter format (peft/adapter_format.py): ftcore's adapter names to PEFT
keys, a shared A written once per slice, and a directory written and read back."""

from __future__ import annotations

import pytest
import torch

from ftcore.peft.adapter_format import read_adapter, save_adapter, to_peft
from ftcore.peft.config import Geometry, LoraSettings
from tests.support.adapters import full_adapters

GEO = Geometry(hidden=8, ffn=12, heads=4, groups=2, head_dim=2)
KEY = "base_model.model.model.layers.0.self_attn.{}.lora_{}.weight"


@pytest.mark.parametrize("shared", [False, True])
def test_peft_keys_and_shared_A_copied(shared):
    full = full_adapters(GEO, shared)
    sd, targets = to_peft(full)
    assert targets == ["q_proj", "k_proj", "v_proj", "down_proj"]
    assert set(sd) == {KEY.format(s, ab) for s in ("q_proj", "k_proj", "v_proj") for ab in "AB"} | {
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight",
    }
    if shared:
        a = full["decoder.layers.0.self_attention.linear_qkv.lora_A.linear_qkv"]
        assert all(torch.equal(sd[KEY.format(s, "A")], a) for s in ("q_proj", "k_proj", "v_proj"))


def test_adapter_directory_round_trip(tmp_path):
    """What save_adapter writes, read_adapter reads back: the tensors and PEFT's LoraConfig."""
    sd, targets = to_peft(full_adapters(GEO, shared=False))
    save_adapter(
        tmp_path / "ad", sd, LoraSettings(2, 4.0, 0.1, tuple(targets), True), targets, None
    )
    config, back = read_adapter(tmp_path / "ad")
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (2, 4.0, True)
    assert config["target_modules"] and set(config["target_modules"]) == set(targets)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    assert not (tmp_path / "ad.tmp").exists()
