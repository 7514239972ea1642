"""Stop requests: a signal to one rank, the stop file, run.max_time -> every rank saves the same
step at the next step boundary and raises StopRequested (exit 3); handlers exist only while
fit() runs, and not at all with run.handle_signals=false.

The gloo pool for the cases; the same with real processes (a signal to one trainer rank, the stop
file through ftcore's own launcher) is in test_resume_kill.py, next to its reference run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ftcore.errors import StopRequested
from ftcore.training import trainer
from tests.support.ckpt_cases import ROOT, build_resumed, latest, metric_lines


def fit_until_stop(overrides: list[str], run_dir: str, signal_rank1_at: int = 0) -> dict:
    """fit(); rank 1 sends itself SIGUSR1 while fetching the batch of step `signal_rank1_at`."""
    import torch.distributed as dist

    state = build_resumed(overrides, run_dir)
    if signal_rank1_at and dist.get_rank() == 1:
        inner = state.loader.next_microbatches

        def next_microbatches():
            if state.step + 1 == signal_rank1_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            return inner()

        state.loader.next_microbatches = next_microbatches
    before = signal.getsignal(signal.SIGUSR1)
    try:
        trainer.fit(state)
        stopped = None
    except StopRequested as e:
        stopped = (e.step, e.reason)
    return {
        "stopped": stopped,
        "step": state.step,
        "restored": signal.getsignal(signal.SIGUSR1) == before,
    }


POOL = ["train.max_steps=4", "checkpoint.keep=0"]


@pytest.mark.dist
def test_signal_to_one_rank_stops_all(pool2, tmp_path):
    res = pool2.run(fit_until_stop, POOL, str(tmp_path), signal_rank1_at=2)
    assert [r["stopped"][0] for r in res] == [2, 2], res
    assert "SIGUSR1" in res[1]["stopped"][1]
    assert all(r["restored"] for r in res)  # handlers released after fit()
    assert latest(tmp_path) == "step_2"


@pytest.mark.dist
def test_stop_file_and_max_time(pool2, tmp_path):
    (tmp_path / "STOP").write_text("")
    res = pool2.run(fit_until_stop, POOL, str(tmp_path))
    assert [r["stopped"][0] for r in res] == [1, 1] and "stop file" in res[0]["stopped"][1]
    assert latest(tmp_path) == "step_1" and not (tmp_path / "STOP").exists()  # consumed
    res = pool2.run(fit_until_stop, POOL + ["run.max_time=0.000001"], str(tmp_path))
    assert [r["stopped"] for r in res] == [(2, "run.max_time")] * 2
    assert latest(tmp_path) == "step_2"
    res = pool2.run(fit_until_stop, POOL, str(tmp_path))  # the rest of the run
    assert [r["stopped"] for r in res] == [None, None] and res[0]["step"] == 4
    assert [r["step"] for r in metric_lines(tmp_path)] == [1, 2, 3, 4]


_HANDLERS = """
import os, signal, sys, time
from types import SimpleNamespace as NS
from ftcore.runtime import signals
cfg = NS(run=NS(handle_signals=sys.argv[1] == "1", stop_file=None, max_time=None))
signals.install(cfg)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("survived SIGTERM, flagged:", signals._received, flush=True)
signals.uninstall()
print("default restored:", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(2)
print("still alive", flush=True)
"""


@pytest.mark.parametrize("enabled", [True, False])
def test_handlers_only_when_enabled_and_released(enabled):
    out = subprocess.run([sys.executable, "-c", _HANDLERS, "1" if enabled else "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == -signal.SIGTERM, out.stderr[-2000:]
    if enabled:
        assert "flagged: ['SIGTERM']" in out.stdout and "default restored: True" in out.stdout
    else:
        assert out.stdout == ""
    assert "still alive" not in out.stdout
