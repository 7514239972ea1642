"""One live run per run directory (ftcore/runtime/run_lock.py): a second start is refused naming
the holder; the lock goes with the last process that holds it, however it ends; a run that wrote
nothing leaves nothing; a link or another user's file at the lock's name is refused."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ftcore.errors import FtcoreError
from ftcore.runtime import run_lock
from tests.support.cli import ROOT

HOLD = """
import sys, time
from ftcore.runtime import run_lock
run_lock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding tmp_path/run; killed (SIGKILL: no release) at the end."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    yield run, proc
    proc.kill()
    proc.wait()


def test_a_second_start_is_refused_naming_the_holder_until_it_is_killed(holder):
    run, proc = holder
    with pytest.raises(FtcoreError) as e:
        run_lock.acquire(run)
    text = str(e.value)
    assert text.startswith(f"run.dir: {run} is in use by a live run (pid {proc.pid} on host ")
    assert socket.gethostname() in text and "started " in text and "fix: " in text
    proc.send_signal(signal.SIGKILL)  # no release, no cleanup: the kernel drops the lock
    proc.wait()
    held = run_lock.acquire(run)
    try:
        assert held is not None and (run / run_lock.LOCK_NAME).is_file()
    finally:
        run_lock.release()
    assert run.is_dir() and not any(run.iterdir())  # the killed holder made it: kept


def test_a_run_that_wrote_nothing_leaves_nothing(tmp_path):
    run = tmp_path / "a" / "run"
    run_lock.acquire(run)
    assert oct(run.stat().st_mode & 0o777) == "0o700"  # private
    run_lock.release()
    assert not run.exists()
    run_lock.acquire(run)
    (run / "config.yaml").write_text("x: 1\n")
    run_lock.release()
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]  # the run's, not the lock


LAUNCHER = """
import subprocess, sys, time
from ftcore.runtime import run_lock
held = run_lock.acquire(sys.argv[1])
worker = subprocess.Popen(["sleep", "600"], pass_fds=(held.fd,))
run_lock.note(workers=[worker.pid])
print(worker.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_launchers_workers_keep_the_lock_and_are_named(tmp_path):
    """A launcher's workers inherit its locked file: SIGKILL the launcher and the run.dir stays
    locked while they live, the refusal naming them and saying the launcher is gone."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(run)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    worker = int(proc.stdout.readline())
    try:
        proc.kill()
        proc.wait()
        with pytest.raises(FtcoreError) as e:
            run_lock.acquire(run)
        assert f"workers {worker}; pid {proc.pid} is gone, its workers are still stopping" in str(
            e.value
        )
    finally:
        os.kill(worker, signal.SIGKILL)
    for _ in range(100):  # the worker's exit closes the last descriptor: the lock is free
        try:
            run_lock.acquire(run)
            break
        except FtcoreError:
            time.sleep(0.05)
    run_lock.release()


def test_a_link_or_another_users_lock_file_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    (run / run_lock.LOCK_NAME).symlink_to(victim)
    with pytest.raises(FtcoreError, match="cannot be opened as this run's lock"):
        run_lock.acquire(run)
    assert victim.read_text() == "mine\n"
    if os.getuid() != 0:
        return
    import pwd

    (run / run_lock.LOCK_NAME).unlink()
    (run / run_lock.LOCK_NAME).write_text("")
    os.chown(run / run_lock.LOCK_NAME, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(FtcoreError, match="belongs to user id"):
        run_lock.acquire(run)


def test_a_one_process_train_is_refused_before_anything_is_built(holder):
    """`python -m ftcore.train ... run.dir=<in use>` alone: launch_standalone refuses it right
    after the config checks (here: none), before the process group or any model exists."""
    from ftcore.config.schema import compose
    from ftcore.runtime import dist as rdist

    run, proc = holder
    cfg = compose(["+exp=tiny_full", f"run.dir={run}"])
    with pytest.raises(FtcoreError) as e:
        rdist.launch_standalone(cfg, "ftcore.train", lambda cfg, nproc: None)
    assert f"{run} is in use by a live run (pid {proc.pid} " in str(e.value)
    assert rdist.launch_standalone(cfg.copy(), "ftcore.eval", lambda cfg, nproc: None) is None
