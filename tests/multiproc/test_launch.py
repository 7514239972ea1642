"""`python -m ftcore.train` end to end: standalone local workers, exit statuses, reproducibility."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny import TINY


def train(*overrides, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "ftcore.train", *TINY, *overrides],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r]


@pytest.mark.dist
def test_standalone_two_workers_tp2(tmp_path):
    r = train(
        "launcher.nproc_per_node=2", "parallel.tp=2", "train.max_steps=3", f"run.dir={tmp_path}"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in records if "loss" in x]
    assert [x["step"] for x in steps] == [1, 2, 3]
    for key in ("lr", "grad_norm", "tokens", "target_tokens", "tokens_per_s", "tokens_per_s_per_gpu",
                "step_time_s", "model_tflops_per_gpu", "peak_mem_gib"):  # fmt: skip
        assert key in steps[0], key
    assert steps[0]["tokens_per_s_per_gpu"] == pytest.approx(steps[0]["tokens_per_s"] / 2)


@pytest.mark.dist
def test_worker_user_error_exits_2_and_stops_all(tmp_path):
    r = train(
        "launcher.nproc_per_node=2",
        f"data.path={tmp_path}/missing.jsonl",
        f"run.dir={tmp_path}/run",
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "missing.jsonl" in r.stderr


def test_world_size_not_divisible_exits_2_before_launch(tmp_path):
    r = train("launcher.nproc_per_node=3", "parallel.tp=2", f"run.dir={tmp_path}")
    assert r.returncode == 2
    assert "parallel.tp/parallel.pp/parallel.cp" in r.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.dist
def test_single_process_run_is_reproducible_bit_for_bit(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        r = train("train.max_steps=3", f"run.dir={d}")
        assert r.returncode == 0, r.stderr[-3000:]
    assert losses(a) == losses(b)
    c = tmp_path / "c"
    assert train("train.max_steps=3", "run.seed=7", f"run.dir={c}").returncode == 0
    assert losses(c) != losses(a)
