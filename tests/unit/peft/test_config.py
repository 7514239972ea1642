"""LoRA settings and their checks (peft/config.py): target planning, scaling, an adapter's own
settings, an adapter of another base, and the bad-input contract (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.peft.config import check_adapter_fits, check_config, plan_targets, scaling, settings
from tests.support.adapters import adapter_dir
from tests.support.tiny import TINY

ROOT = Path(__file__).resolve().parents[3]


def test_plan_hf_names_get_one_adapter_per_slice():
    plan = plan_targets(["q_proj", "v_proj", "down_proj"])
    assert plan == {
        "linear_qkv": {"q_proj": "q_proj", "v_proj": "v_proj"},
        "linear_fc2": {"down_proj": "down_proj"},
    }


def test_plan_megatron_names_share_A():
    plan = plan_targets(["linear_qkv", "linear_fc1", "linear_proj"])
    assert plan["linear_qkv"] == {
        "q_proj": "linear_qkv",
        "k_proj": "linear_qkv",
        "v_proj": "linear_qkv",
    }
    assert plan["linear_fc1"] == {"gate_proj": "linear_fc1", "up_proj": "linear_fc1"}
    assert plan["linear_proj"] == {"o_proj": "o_proj"}


@pytest.mark.parametrize("targets", [["q_proj", "foo"], ["linear_qkv", "q_proj"], ["lm_head"]])
def test_plan_refuses_unknown_or_overlapping(targets):
    with pytest.raises(FtcoreError) as e:
        plan_targets(targets)
    assert e.value.field == "peft.target_modules"


def test_rslora_scaling():
    assert scaling(16, 32, False) == 2.0
    assert scaling(16, 32, True) == 8.0


def test_adapter_config_fixes_settings(tmp_path):
    ad = adapter_dir(tmp_path / "ad", ["q_proj", "v_proj"], r=4)
    cfg = compose(TINY + ["peft=lora", "peft.r=16", f"peft.adapter_path={ad}"])
    s = settings(cfg)
    assert (s.r, s.alpha, s.targets) == (4, 8.0, ("q_proj", "v_proj"))
    assert json.loads((ad / "adapter_config.json").read_text())["peft_type"] == "LORA"
    check_config(cfg)


def test_adapter_of_another_base_is_refused(tmp_path):
    cfg = compose(TINY + ["peft=lora"])
    with pytest.raises(FtcoreError) as e:
        check_adapter_fits(adapter_dir(tmp_path / "ad", ["q_proj"], hidden=128), cfg.model)
    assert "another base" in str(e.value)
    with pytest.raises(FtcoreError):
        check_adapter_fits(adapter_dir(tmp_path / "ad", ["q_proj"], layers=6), cfg.model)


def test_adapter_checks_import_no_torch(tmp_path):
    """The config checks read an adapter's shapes from the safetensors header: a mismatched
    adapter is refused in a process that never imports torch (the config-error path)."""
    ad = adapter_dir(tmp_path / "ad", ["q_proj"], hidden=128)
    code = (
        "import sys\n"
        "from ftcore.config.schema import compose\n"
        "from ftcore.errors import FtcoreError\n"
        "from ftcore.peft.config import check_config\n"
        "from tests.support.tiny import TINY\n"
        f"cfg = compose(TINY + ['peft=lora', 'peft.adapter_path={ad}'])\n"
        "try:\n"
        "    check_config(cfg)\n"
        "except FtcoreError as e:\n"
        "    print('refused:', 'another base' in str(e))\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split("\n")[:2] == ["refused: True", "torch imported: False"], p.stdout


def _exit(argv) -> int:
    from ftcore.cli import main
    from ftcore.train import task

    return main("train", task, TINY + argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["peft=lora", "peft.target_modules=[q_proj,attn_out]"],
        ["peft=lora", "peft.r=0"],
        ["peft=lora", "peft.r=-4"],
        ["peft=qlora", "precision=fp8_delayed"],
        ["peft=qlora", "precision=nvfp4"],
    ],
    ids=["unknown_target", "rank0", "rank_negative", "qlora_fp8", "qlora_fp4"],
)
def test_bad_input_exits_2(argv, capsys):
    assert _exit(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_mismatched_adapter_exits_2(tmp_path, capsys):
    ad = adapter_dir(tmp_path / "ad", ["q_proj"], hidden=128)
    assert _exit(["peft=lora", f"peft.adapter_path={ad}"]) == 2
    assert "another base" in capsys.readouterr().err


def test_qlora_refused_on_a_base_with_qkv_bias():
    with pytest.raises(FtcoreError, match="no bias") as e:
        check_config(compose(["+exp=qwen25_72b_lora", "peft=qlora", "precision=bf16"]))
    assert e.value.field == "peft.name"
    check_config(compose(["+exp=qwen25_72b_lora"]))  # LoRA is fine
