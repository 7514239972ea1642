"""Run an entry point as a user types it, in its own process, and read its one error line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# What makes a process take itself for a launched rank (tests start theirs without them).
LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
ROOT = Path(__file__).resolve().parents[2]
# The question several tests ask the bundled tiny_lora base (the `base_answer` fixture asks it once).
QUESTION = ("generate.prompt=What is 2 + 3?", "generate.max_new_tokens=8")


def cli(
    module: str, *argv: str, cwd: Path = ROOT, timeout: int = 300, **kw
) -> subprocess.CompletedProcess:
    """`python -m ftcore.<module> argv` with the log level a user sees (the suite's is WARNING)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env["FTCORE_LOG_LEVEL"] = "INFO"
    return subprocess.run([sys.executable, "-m", f"ftcore.{module}", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, **kw)  # fmt: skip


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one `ftcore error:` line, with exit 2 and no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ftcore error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]
