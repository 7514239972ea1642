"""adapter_config.json written without peft (peft/adapter_config.py), held to the installed PEFT:
the same keys and values as `LoraConfig(...).save_pretrained`, the same LoraConfig read back, and
a directory PEFT's loader puts onto a transformers model."""

from __future__ import annotations

import json

import pytest
import torch

from ftcore.peft.adapter_config import PEFT_VERSION, write_adapter_config
from ftcore.peft.adapter_format import save_adapter, to_peft
from ftcore.peft.config import CONFIG_FILE, Geometry, LoraSettings
from tests.support.adapters import full_adapters

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = [  # (r, alpha, dropout, targets, rslora, base)
    (2, 4.0, 0.1, ["q_proj", "k_proj", "v_proj", "down_proj"], True, None),
    (16, 32, 0.0, ALL7, False, "/abs/path/to/tiny_base"),
    (8, 16.0, 0.05, ["q_proj", "v_proj"], False, "meta-llama/Llama-3.1-8B"),
    (4, 8, 0.0, ["gate_proj", "up_proj"], True, None),
]


def peft_config(r, alpha, dropout, targets, rslora, base):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                      use_rslora=rslora, bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}-{len(c[3])}targets")
def test_file_equals_peft_save_pretrained(tmp_path, case):
    """It reads back into the LoraConfig PEFT builds from the same settings, and under the PEFT
    release the table copies it is, key for key and value for value, the file PEFT writes
    (target_modules: PEFT writes a set, in an order that varies by process; ftcore writes the
    order given). Under another PEFT release only the read-back is asked: a release that adds a
    field reads ours with its default, and CI must not fail on a registry's new release."""
    import peft
    from peft import LoraConfig

    r, alpha, dropout, targets, rslora, base = case
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    ours_dir.mkdir()
    write_adapter_config(ours_dir, LoraSettings(r, alpha, dropout, tuple(targets), rslora),
                         targets, base)  # fmt: skip
    oracle = peft_config(*case)
    oracle.save_pretrained(str(theirs_dir))
    ours = json.loads((ours_dir / CONFIG_FILE).read_text())
    theirs = json.loads((theirs_dir / CONFIG_FILE).read_text())
    assert LoraConfig.from_pretrained(str(ours_dir)) == oracle
    assert ours.pop("target_modules") == targets
    assert sorted(theirs.pop("target_modules")) == sorted(targets)
    if peft.__version__ == PEFT_VERSION:
        assert ours == theirs


def test_peft_loads_the_directory_onto_a_transformers_model(tmp_path):
    """save_adapter's directory through PeftModel.from_pretrained onto a Llama of the adapter's
    shape: every tensor lands where PEFT looks for it, with PEFT's scaling for these settings."""
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    geo = Geometry(hidden=8, ffn=12, heads=4, groups=2, head_dim=2)
    sd, targets = to_peft(full_adapters(geo, shared=True))
    s = LoraSettings(2, 3.0, 0.0, tuple(targets), True)
    save_adapter(tmp_path / "ad", sd, s, targets, None)
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=2,
                                        vocab_size=16))  # fmt: skip
    model = PeftModel.from_pretrained(base, str(tmp_path / "ad"))
    loaded = {k.replace(".default.", "."): v for k, v in model.state_dict().items() if "lora_" in k}
    assert set(loaded) == set(sd)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    attn = model.base_model.model.model.layers[0].self_attn
    assert attn.q_proj.scaling["default"] == pytest.approx(s.scale)
