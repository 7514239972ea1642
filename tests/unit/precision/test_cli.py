"""The user-facing refusal: an FP8/FP4 run on a machine without the GPU exits 2 with one line
naming `precision`, what it needs and what would run instead, and no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _train_importable() -> bool:
    try:
        import ftcore.training.trainer  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the CPU refusal")
@pytest.mark.skipif(not _train_importable(), reason="ftcore.training.trainer is not importable yet")
def test_train_fp8_on_cpu_exits_2_without_traceback(tmp_path: Path):
    # on cluster=local_cpu: a GPU cluster (exp/70b_fp8) is refused before this, for having no CUDA
    # device at all (tests/unit/validation/test_preflight.py)
    args = ["+exp=tiny_full", "precision=fp8_cs"]
    proc = subprocess.run(
        [sys.executable, "-m", "ftcore.train", *args, f"run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("ftcore error:")]
    assert len(line) == 1, proc.stderr[-2000:]
    assert "precision:" in line[0] and "compute capability" in line[0]
    assert "no CUDA device" in line[0] and "precision=bf16" in line[0]
