"""adapter_config.json as PEFT's `LoraConfig(...).save_pretrained` writes it, without peft.

The peft package imports transformers' model code and accelerate on import (~2.5 s of CPU in
every process that writes an adapter, for one small JSON file). This writes the same file: the
fields of PEFT 0.21.2's LoraConfig at their defaults, ftcore's settings over them, dumped as PEFT
dumps them (indent 2, sorted keys). tests/unit/peft/test_adapter_config.py holds it to the
installed PEFT's own file, key for key under that release (a change there is the signal to update
the table), and under any release to reading back as the LoraConfig PEFT builds itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from ftcore.peft.config import CONFIG_FILE, LoraSettings

# The PEFT release whose LoraConfig this reproduces (PEFT stamps its own version in the file).
PEFT_VERSION = "0.21.2"

# LoraConfig's fields that ftcore leaves at PEFT's defaults, as to_dict() gives them.
DEFAULTS = {
    "alora_invocation_tokens": None,
    "alpha_pattern": {},
    "arrow_config": None,
    "auto_mapping": None,
    "corda_config": None,
    "ensure_weight_tying": False,
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": False,
    "init_lora_weights": True,
    "kasa_config": None,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_bias": False,
    "lora_ga_config": None,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "monteclora_config": None,
    "peft_type": "LORA",
    "qalora_group_size": 16,
    "rank_pattern": {},
    "revision": None,
    "target_parameters": None,
    "trainable_token_indices": None,
    "use_bdlora": None,
    "use_dora": False,
    "use_qalora": False,
    "velora_config": None,
}


def lora_config(
    s: LoraSettings, targets: list[str], base: str | None, target_parameters=None
) -> dict:
    """The dict `LoraConfig(r=, lora_alpha=, lora_dropout=, target_modules=, use_rslora=,
    bias="none", task_type="CAUSAL_LM", base_model_name_or_path=).to_dict()` gives, with the
    target modules as a list in the order given (PEFT keeps a set: its order varies by process)."""
    return {
        **DEFAULTS,
        "r": s.r,
        "lora_alpha": s.alpha,
        "lora_dropout": s.dropout,
        "target_modules": list(targets),
        "use_rslora": s.rslora,
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "peft_version": PEFT_VERSION,
        "target_parameters": target_parameters,  # a MoE's dense MLPs (peft/moe_format.py)
    }


def write_adapter_config(
    directory, s: LoraSettings, targets: list[str], base: str | None, target_parameters=None
) -> Path:
    """`<directory>/adapter_config.json`, byte for byte as PEFT writes it (up to target order)."""
    path = Path(directory) / CONFIG_FILE
    config = lora_config(s, targets, base, target_parameters)
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return path
