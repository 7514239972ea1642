"""Exact resume with real processes: SIGKILL both ranks after the step-6 checkpoint is published,
then again in the middle of the step-9 save; stop requests (a signal to one rank, the stop file);
each restart continues as if nothing happened.

The tiny model on the bundled data, 2 ranks (TP=2, and separately PP=2), fp32 on CPU: every step
of metrics.jsonl (loss, lr, grad_norm, tokens) and the exported final weights equal the
uninterrupted run's to the last bit."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.support.ckpt_cases import Workers, last_step, latest, same_final_weights, same_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# 16 steps (E2E's 12, and room for two stop requests after the step-9 crash)
TP2 = ["parallel.tp=2", "train.max_steps=16"]


@pytest.fixture(scope="module")
def reference_tp2(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref_tp2")
    w = Workers(run_dir, [*TP2, "checkpoint.interval=3"], run_dir / "log.txt")
    assert w.wait() == [0, 0], w.text()[-3000:]
    return run_dir


def _kill_when(w: Workers, ready) -> None:
    """Freeze both ranks the moment `ready()` holds (SIGSTOP), then SIGKILL them: what the
    directory holds at the freeze is what a crash at that moment leaves behind."""
    w.until(ready)
    w.signal(signal.SIGSTOP)
    frozen = ready()
    w.kill()
    assert frozen, "the run moved past the point to kill at before it was frozen; rerun"


def logged_step(w: Workers) -> int:
    """The last step this start has logged (its own log: the run directory's metrics.jsonl still
    holds the lines of the start before until it resumes)."""
    steps = re.findall(r"\bstep (\d+)/\d+ \|", w.text())
    return int(steps[-1]) if steps else 0


@pytest.mark.timeout(900)  # six starts with its reference: what two tests of 600 s each ran
def test_kills_then_stop_requests_tp2(reference_tp2, tmp_path):
    """One run directory through every way a TP=2 run ends early, each start resuming where the
    one before left off (one chain, not two: a 2-rank start costs ~30 s of CPU):
    1. SIGKILL both ranks once step_6 is published; 2. SIGKILL both in the middle of the step-9
    save; 3. the next start ignores the incomplete save, resumes from step_6, and is stopped by
    SIGUSR1 to rank 1 only (as a scheduler's signal to one task); 4. the stop file, through
    ftcore's own launcher; 5. the last start completes. Each stop request gives exit 3 and a
    checkpoint of the step it was asked in (or the next, if the request came after that step's
    check), whatever the interval (0 from start 3 on); the metrics, every step once, and the final
    weights equal the uninterrupted run's."""
    run_dir = tmp_path / "run"
    over = [*TP2, "checkpoint.interval=3"]
    stop_over = [*TP2, "checkpoint.interval=0"]  # a stop request saves whatever the interval
    # 1. SIGKILL both ranks once step_6 is published.
    w = Workers(run_dir, over, tmp_path / "log1.txt")
    _kill_when(w, lambda: latest(run_dir) == "step_6")
    # 2. Resume from step 6; SIGKILL both in the middle of the step-9 save (files written, not
    #    yet renamed or published).
    tmp9 = run_dir / "checkpoints" / ".tmp_step_9"
    w = Workers(run_dir, over, tmp_path / "log2.txt")
    _kill_when(w, lambda: tmp9.is_dir() and any(tmp9.iterdir()) and latest(run_dir) == "step_6")
    assert "resumed from" in w.text() and re.search(r"resumed from \S+step_6 at step 6", w.text())
    # 3. The next start ignores the incomplete save and loads step_6; SIGUSR1 to rank 1 stops it.
    w = Workers(run_dir, stop_over, tmp_path / "log3.txt")
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
    # 4. The stop file, through ftcore's own launcher.
    w = Workers(run_dir, stop_over, tmp_path / "log4.txt", launcher=True)
    w.until(lambda: last_step(run_dir) >= stopped + 2, poll=0.01)
    asked, t0 = last_step(run_dir), time.time()
    (run_dir / "STOP").write_text("")
    assert w.wait() == [3], w.text()[-3000:]
    stopped = last_step(run_dir)
    print(f"stop file at step {asked}: exit 3 at step {stopped} after {time.time() - t0:.1f} s")
    assert stopped in (asked, asked + 1) and latest(run_dir) == f"step_{stopped}"
    assert not (run_dir / "STOP").exists()
    # 5. The last start completes the run.
    w = Workers(run_dir, stop_over, tmp_path / "log5.txt")
    assert w.wait() == [0, 0], w.text()[-3000:]
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
