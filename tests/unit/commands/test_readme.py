"""The README's quick start, run exactly as it stands: a user's own JSONL -> LoRA adapter ->
generation with it -> PEFT loads it. If the README changes, this runs the new text."""

from __future__ import annotations

import os
import re
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
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout.splitlines()
    assert len(out) == 2 and out[0].strip(), p.stdout  # the answer alone, then PEFT's model class
    assert out[1] == "PeftModelForCausalLM", p.stdout
    assert (tmp_path / "outputs" / "mine" / "hf_adapter" / "adapter_config.json").is_file()
