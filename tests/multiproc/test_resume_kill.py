"""Exact resume with real processes: SIGKILL both ranks after the step-6 checkpoint is published
(TP=2: frozen at that moment, what it leaves compared with what the next start loads), then in the
middle of the step-9 save; stop requests (a signal to one rank, Ctrl-C to the launcher); each restart
continues as if nothing happened; Ctrl-C to ftcore's local launcher, then the resume command it
printed.

The tiny model on the bundled data, 2 ranks (TP=2, and separately PP=2), fp32 on CPU: every step
of metrics.jsonl (loss, lr, grad_norm, tokens) and the exported final weights equal the
uninterrupted run's to the last bit."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.ckpt_cases import (
    ROOT,
    Workers,
    last_step,
    latest,
    same_final_weights,
    same_metrics,
)

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# 16 steps (E2E's 12, and room for two stop requests after the step-9 crash)
TP2 = ["parallel.tp=2", "train.max_steps=16"]


@pytest.fixture(scope="module")
def reference_tp2(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref_tp2")
    w = Workers(run_dir, [*TP2, "checkpoint.interval=3"], run_dir / "log.txt")
    assert w.wait() == [0, 0], w.text()[-3000:]
    return run_dir


def _freeze_when(w: Workers, ready) -> None:
    """Freeze both ranks (SIGSTOP) the moment `ready()` holds: what the directory holds then is
    what a crash at that moment leaves behind."""
    w.until(ready)
    w.signal(signal.SIGSTOP)
    if not ready():
        w.kill()
        raise AssertionError("the run moved past the point to freeze at before it froze; rerun")


def _kill_when(w: Workers, ready) -> None:
    """SIGKILL both ranks at the moment `ready()` holds (frozen first)."""
    _freeze_when(w, ready)
    w.kill()


def _files(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def logged_step(w: Workers) -> int:
    """The last step this start has logged (its own log: the run directory's metrics.jsonl still
    holds the lines of the start before until it resumes)."""
    steps = re.findall(r"\bstep (\d+)/\d+ \|", w.text())
    return int(steps[-1]) if steps else 0


@pytest.mark.timeout(900)  # five starts with its reference: what two tests of 600 s each ran
def test_kills_then_stop_requests_tp2(reference_tp2, tmp_path):
    """One run directory through every way a TP=2 run ends early, each start resuming where the
    one before left off (one chain, not two: a 2-rank start costs ~30 s of CPU):
    1. both ranks frozen the moment step_6 is published (what a SIGKILL then leaves behind), then
    let go and SIGKILLed in the middle of the step-9 save; 2. the next start ignores the
    incomplete save, resumes from step_6, exactly the files that were there at its publication,
    and is stopped by SIGUSR1 to rank 1 only (as a scheduler's signal to one task); 3. the stop
    Ctrl-C to ftcore's own launcher; 4. the command it printed completes the run. Each stop request gives
    exit 3 and a checkpoint of the step it was asked in (or the next, if the request came after
    that step's check), whatever the interval (0 from start 2 on); the metrics, every step once,
    and the final weights equal the uninterrupted run's. (A start killed right after a publish
    and resumed: test_kill_after_publish_pp2.)"""
    run_dir = tmp_path / "run"
    over = [*TP2, "checkpoint.interval=3"]
    stop_over = [*TP2, "checkpoint.interval=0"]  # a stop request saves whatever the interval
    # 1. Frozen once step_6 is published: its files and `latest` then are what a crash at that
    #    moment leaves. Let go, SIGKILL both in the middle of the step-9 save (files written, not
    #    yet renamed or published).
    ckpts, tmp9 = run_dir / "checkpoints", run_dir / "checkpoints" / ".tmp_step_9"
    w = Workers(run_dir, over, tmp_path / "log1.txt")
    _freeze_when(w, lambda: latest(run_dir) == "step_6")
    at_publish = _files(ckpts / "step_6")
    assert at_publish and (ckpts / "latest").read_text().strip() == "step_6"
    w.signal(signal.SIGCONT)
    _kill_when(w, lambda: tmp9.is_dir() and any(tmp9.iterdir()) and latest(run_dir) == "step_6")
    assert _files(ckpts / "step_6") == at_publish, "step_6 changed after it was published"
    # 2. The next start ignores the incomplete save and loads step_6; SIGUSR1 to rank 1 stops it.
    w = Workers(run_dir, stop_over, tmp_path / "log2.txt")
    w.until(lambda: logged_step(w) >= 7, poll=0.01)
    asked, t0 = logged_step(w), time.time()
    w.signal(signal.SIGUSR1, ranks=[1])
    assert w.wait() == [3, 3], w.text()[-3000:]
    log = w.text()
    assert re.search(r"ignoring incomplete checkpoint \S+\.tmp_step_9", log), log[-3000:]
    assert re.search(r"resumed from \S+step_6 at step 6", log), log[-3000:]
    stopped = logged_step(w)
    print(f"signal at step {asked}: exit 3 at step {stopped} after {time.time() - t0:.1f} s")
    assert stopped in (asked, asked + 1) and latest(run_dir) == f"step_{stopped}"
    assert last_step(run_dir) == stopped
    assert not tmp9.exists()  # removed by the next successful save
    # 3. Ctrl-C to ftcore's own launcher (the parent of 2 workers), as a terminal sends it.
    w = Workers(run_dir, stop_over, tmp_path / "log3.txt", launcher=True)
    w.until(lambda: last_step(run_dir) >= stopped + 2, poll=0.01)
    asked, t0 = last_step(run_dir), time.time()
    w.signal(signal.SIGINT, ranks=[0])
    assert w.wait() == [3], w.text()[-3000:]
    stopped = last_step(run_dir)
    print(f"Ctrl-C at step {asked}: exit 3 at step {stopped} after {time.time() - t0:.1f} s")
    assert stopped in (asked, asked + 1) and latest(run_dir) == f"step_{stopped}"
    log = w.text()
    assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
    # 4. The command the stop printed (the launcher again) completes the run.
    (line,) = [ln for ln in log.splitlines() if "resume with: " in ln]
    cmd = shlex.split(line.split("resume with: ", 1)[1])
    assert cmd[:3] == ["python", "-m", "ftcore.train"] and f"run.dir={run_dir}" in cmd, cmd
    done = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, env=w.env, capture_output=True,
                          text=True, timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    same_metrics(run_dir, reference_tp2)
    same_final_weights(run_dir, reference_tp2)


def test_kill_after_publish_pp2(tmp_path):
    over = ["parallel.pp=2", "checkpoint.interval=6"]
    ref = tmp_path / "ref"
    w = Workers(ref, over, tmp_path / "ref.txt")
    assert w.wait() == [0, 0], w.text()[-3000:]
    run_dir = tmp_path / "run"
    w = Workers(run_dir, over, tmp_path / "log1.txt")
    _kill_when(w, lambda: latest(run_dir) == "step_6")
    w = Workers(run_dir, over, tmp_path / "log2.txt")
    assert w.wait() == [0, 0], w.text()[-3000:]
    assert re.search(r"resumed from \S+step_6 at step 6", w.text())
    same_metrics(run_dir, ref)
    same_final_weights(run_dir, ref)
