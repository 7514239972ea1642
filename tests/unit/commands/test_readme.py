"""The README's quick start, run exactly as it stands: a user's own JSONL -> LoRA adapter ->
generation with it -> PEFT loads it. If the README changes, this runs the new text. Also what the
quick start promises of the adapter: it changes the model (issue 52: its one step trained at lr 0
and wrote all-zero lora_B), adapter_config.json names the base by a path that resolves (PEFT finds
it without the Hub), and its files follow the user's umask (not safetensors' 0600)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def quick_start_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return block


def test_readme_quick_start_runs_as_written(tmp_path):
    block = quick_start_block()
    assert "ftcore.train" in block and "ftcore.generate" in block and "peft" in block
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # the block activates the clone's venv
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env.update(FTCORE_LOG_LEVEL="INFO", HF_HUB_OFFLINE="1")  # a base that does not resolve fails
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", "umask 002\n" + block], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout.splitlines()
    assert len(out) == 2 and out[0].strip(), p.stdout  # the answer alone, then PEFT's model class
    assert out[1] == "PeftModelForCausalLM", p.stdout
    adapter = tmp_path / "outputs" / "mine" / "hf_adapter"
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str((ROOT / "ftcore" / "assets" / "tiny_base").resolve())
    for f in adapter.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o664, f  # umask 002
    trained_and_logged(p.stderr, adapter)


def trained_and_logged(log: str, adapter: Path) -> None:
    """Every step line's lr is the one its update applied, and the adapter changes the model.
    Adam's first update moves each weight by the lr (m/sqrt(v) = sign(g)), so after the quick
    start's one step every lora_B (zero at the start) holds values of exactly that size: the
    logged lr is the applied one. PEFT's model then gives other logits than the base."""
    import torch
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
