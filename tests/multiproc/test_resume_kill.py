"""Exact resume with real processes: SIGKILL both ranks after the step-6 checkpoint is published
(TP=2: frozen at that moment, what it leaves compared with what the next start loads), then in the
middle of the step-9 save; stop requests (a signal to one rank, Ctrl-C to the launcher); each restart
continues as if nothing happened; Ctrl-C to ftcore's local launcher, then the resume command it
printed. ftcore's local launcher SIGKILLed with its process group at random moments (its workers
stop with it; a second start in the same run.dir meanwhile is refused), each restart resuming.

The tiny model on the bundled data, 2 ranks (TP=2, and separately PP=2), fp32 on CPU: every step
of metrics.jsonl (loss, lr, grad_norm, tokens) and the exported final weights equal the
uninterrupted run's to the last bit."""

from __future__ import annotations

import os
import random
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
from tests.support.procs import HOST, children, off_loopback, running_with

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
    Ctrl-C to ftcore's own launcher; 4. the command it printed, its launcher's process group
    SIGKILLed while training (the same command meanwhile refused: the run.dir is in use; nothing
    of the run listens beyond loopback): the workers save and stop with it; 5. that command
    again completes the run. Each stop gives exit 3 (or, without a launcher left to report it, a
    checkpoint) of the step it was asked in (or the next, if the request came after that step's
    check), whatever the interval (0 from start 2 on); the metrics, every step once, and the
    final weights equal the uninterrupted run's. (A start killed right after a publish and
    resumed: test_kill_after_publish_pp2; the launcher killed six times: the soak below.)"""
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
    # 4. That command (the launcher again), its process group SIGKILLed while training: the
    #    workers save and stop with it (issue 52 item 12; the soak below does it six times);
    #    while it was live the same command was refused, naming it.
    w = Workers(run_dir, [], tmp_path / "log4.txt", launcher=True,
                command=[sys.executable, "-u", *cmd[1:]])  # fmt: skip
    w.until(lambda: logged_step(w) > stopped, poll=0.01)
    _refused_while_live(w, run_dir)
    workers, took = _kill_group_and_watch(w, run_dir)
    log = w.text()
    killed = re.search(r"stopped at step (\d+)", log)
    assert killed, f"the workers went on after their launcher died:\n{log[-3000:]}"
    assert latest(run_dir) == f"step_{killed.group(1)}" == f"step_{last_step(run_dir)}"
    print(f"launcher SIGKILLed at step {stopped}+: its {workers} workers saved step "
          f"{killed.group(1)} and were gone {took:.1f} s later")  # fmt: skip
    # 5. The same command completes the run.
    resumes = run_dir / "checkpoints" / latest(run_dir)
    done = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, env=w.env, capture_output=True,
                          text=True, timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {resumes}" in done.stderr, done.stderr[-3000:]
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


# The soak of issue 52 item 12, by hand: FTCORE_SOAK_KILLS=6 (FTCORE_SOAK_SEED=N replays one
# draw); docs/reliability.md gives the command and the last soak's result. The suite kills the
# launcher once, in test_kills_then_stop_requests_tp2.
KILLS = int(os.environ.get("FTCORE_SOAK_KILLS", "0"))
SEED = int(os.environ.get("FTCORE_SOAK_SEED") or random.randrange(10**6))


def _kill_group_and_watch(w: Workers, run_dir: Path, timeout: float = 120) -> tuple[int, float]:
    """SIGKILL the launcher's process group, as a shell's job control or the OOM killer would end
    it (its workers run in sessions of their own, so the kill does not reach them): how many
    workers it had, and the seconds until no process of the run is left (any started with this
    run.dir, workers included)."""
    assert w.procs[0].poll() is None, f"the run ended before the kill:\n{w.text()[-3000:]}"
    workers = len(children(w.procs[0].pid))
    os.killpg(w.procs[0].pid, signal.SIGKILL)
    w.procs[0].wait(timeout=60)
    t0 = time.time()
    while left := running_with(f"run.dir={run_dir}"):
        assert time.time() - t0 < timeout, f"{left} outlived their launcher:\n{w.text()[-3000:]}"
        time.sleep(0.05)
    w.log.close()
    return workers, time.time() - t0


def _refused_while_live(w: Workers, run_dir: Path) -> None:
    """The same command again while the run is live (its workers frozen meanwhile, so that it
    cannot finish first): exit 2 naming the launcher that holds run.dir."""
    workers = children(w.procs[0].pid)
    assert len(workers) == 2 and off_loopback([w.procs[0].pid, *workers]) == []
    for p in workers:
        os.kill(p, signal.SIGSTOP)
    try:
        again = subprocess.run(w.argv, cwd=ROOT, env=w.env, capture_output=True, text=True,
                               timeout=300)  # fmt: skip
    finally:
        for p in workers:
            os.kill(p, signal.SIGCONT)
    assert again.returncode == 2, again.stderr[-3000:]
    line = again.stderr.strip().splitlines()[-1]
    assert line.startswith(f"ftcore error: run.dir: {run_dir} is in use by a live run"), line
    assert f"pid {w.procs[0].pid} on host {HOST}, started " in line, line


@pytest.mark.skipif(KILLS < 1, reason="the soak: FTCORE_SOAK_KILLS=6 (docs/reliability.md)")
@pytest.mark.timeout(600 + 300 * KILLS)
def test_soak_launcher_killed_at_random_moments(tmp_path):
    """issue 52 item 12's done-when, with `launcher.nproc_per_node=2` (ftcore's own launcher,
    workers in their own sessions), TP=2 and a checkpoint every 2 steps. Each start is SIGKILLed
    with its process group at a random moment: before it started its workers, while they start
    up (imports, setup, the resume's load), or while training (a random delay after one of its
    steps, so sometimes in a save). Every time:
    no worker outlives its launcher (each gets SIGTERM from the kernel: a training one saves at
    the next step boundary and exits); the next start in the same run.dir resumes from the
    newest checkpoint; the last one finishes, and every step and the final weights equal the
    uninterrupted run's to the last bit. At the first kill, while the run is live: nothing of it
    listens beyond loopback, and the same command again is refused (exit 2) naming the live
    launcher's pid, host and start time."""
    rng = random.Random(SEED)
    print(f"FTCORE_SOAK_SEED={SEED} FTCORE_SOAK_KILLS={KILLS}")
    # room for every kill before the end (a training kill moves the run 1-3 steps on)
    over = ["parallel.tp=2", f"train.max_steps={16 + 4 * KILLS}", "checkpoint.interval=2"]
    reference = tmp_path / "ref"
    ref = Workers(reference, over, tmp_path / "ref.txt")
    assert ref.wait() == [0, 0], ref.text()[-3000:]
    run_dir = tmp_path / "run"
    for i in range(KILLS):
        before = latest(run_dir)
        started = _step(before)
        w = Workers(run_dir, over, tmp_path / f"log{i}.txt", launcher=True)
        # the first kill comes while training (then there is a checkpoint to resume from); the
        # others while training, while the workers start up (imports, setup, the resume's load)
        # or before the launcher has started any
        phase = "training" if i == 0 else rng.choices(["training", "workers starting",
                                                       "launcher starting"], [6, 3, 1])[0]  # fmt: skip
        training = phase == "training"
        if training:
            w.until(lambda: logged_step(w) > started, poll=0.01)  # noqa: B023
            if i == 0:
                _refused_while_live(w, run_dir)
            time.sleep(rng.uniform(0.0, 0.6))
        elif phase == "workers starting":
            w.until(lambda: len(children(w.procs[0].pid)) == 2, poll=0.01)  # noqa: B023
            time.sleep(rng.uniform(0.0, 5.0))
        else:
            time.sleep(rng.uniform(0.1, 1.5))
        workers, took = _kill_group_and_watch(w, run_dir)
        log = w.text()
        stopped = re.search(r"stopped at step (\d+)", log)
        if not training:
            phase += f", {max(0, logged_step(w) - started)} steps logged"
        print(f"kill {i + 1} ({phase}, {workers} workers): {before} -> {latest(run_dir)}; no "
              f"process of the run left {took:.1f} s after the launcher; "
              f"{'saved step ' + stopped.group(1) if stopped else 'no save'}")  # fmt: skip
        if training:  # it resumed, and its workers saved and stopped on the way out
            assert before is None or _resumed(log, before), log[-3000:]
            assert stopped, f"the workers went on after their launcher died:\n{log[-3000:]}"
            assert latest(run_dir) == f"step_{stopped.group(1)}" == f"step_{last_step(run_dir)}"
        elif "resumed from" in log:
            assert _resumed(log, before), log[-3000:]
    before = latest(run_dir)
    w = Workers(run_dir, over, tmp_path / "last.txt", launcher=True)
    assert w.wait() == [0], w.text()[-3000:]
    assert _resumed(w.text(), before), w.text()[-3000:]
    same_metrics(run_dir, reference)
    same_final_weights(run_dir, reference)


def _resumed(log: str, step: str) -> bool:
    return re.search(rf"resumed from \S+{step} at step {_step(step)}\b", log) is not None


def _step(name: str | None) -> int:
    return int(name.split("_")[1]) if name else 0
