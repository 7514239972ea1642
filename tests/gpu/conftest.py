"""How the GPU tests run cases and report what they could not run.

A test that needs what this machine lacks is skipped with a reason starting "NOT RUN:", never
passed. Transformer Engine is the exception when `gpu.require_te` is true (FTCORE_GPU_REQUIRE_TE=1,
set in ftcore's container): there its absence is a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.cases import CASES

ROOT = Path(__file__).resolve().parents[2]


def need_te() -> None:
    from ftcore.config.schema import compose
    from ftcore.precision import recipes

    if torch.cuda.is_available() and recipes.te_version() is not None:
        return
    if compose(CASES["bf16_te"].overrides()).gpu.require_te:
        pytest.fail("gpu.require_te=true but Transformer Engine is not installed or does not load")
    pytest.skip("NOT RUN: Transformer Engine is not installed here")


def need_gpus(n: int) -> None:
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"NOT RUN: needs {n} GPUs, this machine has {have}")


def need_runs(name: str) -> None:
    """The case's precision runs on this GPU (the hardware check's own verdict), else NOT RUN."""
    from ftcore.config.schema import compose
    from ftcore.errors import FtcoreError
    from ftcore.precision import hardware

    case = CASES[name]
    if case.te:
        need_te()
    need_gpus(case.gpus)
    try:
        hardware.check_hardware(compose(case.overrides()))
    except FtcoreError as e:
        if e.field == "gpu.require_te":
            pytest.fail(str(e))
        pytest.skip(f"NOT RUN: {name} does not run on this GPU: {e}")


def run_case(tmp: Path, name: str, *more: str, mode: str = "train", run_dir=None, env=None):
    """Run a case in a fresh process (torchrun for several GPUs); its JSON or logits tensor."""
    case = CASES[name]
    out = tmp / f"{name}-{mode}-{len(list(tmp.iterdir()))}.{'pt' if mode == 'logits' else 'json'}"
    args = [mode, str(out), *case.overrides(), f"run.dir={run_dir or tmp / name}", *more]
    if case.gpus > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={case.gpus}",
               "-m", "tests.gpu.worker", *args]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "tests.gpu.worker", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUBLAS_WORKSPACE_CONFIG=":4096:8", **(env or {}))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-6000:]}"
    return torch.load(out) if mode == "logits" else json.loads(out.read_text())


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """Cached case runs: a BF16 reference is trained once for every test comparing with it."""
    cache: dict[tuple, object] = {}

    def get(name: str, *more: str, mode: str = "train"):
        key = (name, more, mode)
        if key not in cache:
            cache[key] = run_case(tmp_path_factory.mktemp(name), name, *more, mode=mode)
        return cache[key]

    return get
