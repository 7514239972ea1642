"""`make gpu-check` on a machine without CUDA: exit 2 with one line, before any install step, and
nothing written (no report, no work folder, no venv)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_gpu_check_refuses_without_cuda(tmp_path):
    # a copy of the repository, so "nothing written" is checked on a tree nobody else writes to
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", ".git", "outputs", ".whl",
                                                              "build", "__pycache__", "*.egg-info"))  # fmt: skip
    (repo / ".whl").mkdir()  # a wheel folder: nothing may be installed from it
    before = sorted(p.relative_to(repo) for p in repo.rglob("*"))
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    cmd = [make, "-s", "gpu-check", f"GPU_PY={sys.executable}"]
    r = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr  # (make's own status for a failed recipe is 2 as well)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("gpu-check:")]
    assert len(lines) == 1 and "no CUDA device" in lines[0], r.stderr
    assert "Installing" not in r.stdout + r.stderr and "pip" not in r.stdout
    after = sorted(p.relative_to(repo) for p in repo.rglob("*") if "__pycache__" not in p.parts)
    assert after == [p for p in before if "__pycache__" not in p.parts]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_gpu_check_script_exit_code_is_2():
    r = subprocess.run([sys.executable, str(ROOT / "tools/gpu_check.py")], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gpu-check: no CUDA device")
