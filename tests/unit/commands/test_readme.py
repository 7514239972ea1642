"""The README's quick start, run exactly as it stands: a user's own JSONL -> LoRA adapter ->
generation with it -> PEFT loads it. If the README changes, this runs the new text. Also what the
quick start promises of the adapter: adapter_config.json names the base by a path that resolves
(PEFT finds it without the Hub), and its files follow the user's umask (not safetensors' 0600)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

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
