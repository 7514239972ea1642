"""The local launcher (launcher.nproc_per_node=N): a stop signal reaches each worker once and
their exit 3 becomes its own, with the time a save takes (more than torch elastic's 30 s grace
would be too slow to test: a few seconds stand for it); a second Ctrl-C aborts them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.cli import LAUNCHER_ENV, ROOT

_PARENT = """
import sys
from pathlib import Path
from ftcore.runtime import local_launch
sys.exit(local_launch.run("tests.support.stop_worker", sys.argv[1:], 2, Path(sys.argv[1])))
"""


def _start(tmp_path, save_s: float) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path), str(save_s)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _ready(tmp_path, proc) -> None:
    end = time.time() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.time() < end, proc.communicate()[0]
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_signal_forwarded_once_and_waited_for(tmp_path, sig):
    proc = _start(tmp_path, save_s=3.0)
    _ready(tmp_path, proc)
    t0 = time.time()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert time.time() - t0 >= 3.0  # the workers' "save" was waited for
    for r in (0, 1):
        assert (tmp_path / f"rank{r}.txt").read_text() == sig.name  # once, not twice
    assert "Traceback" not in out and "SignalException" not in out, out


def test_second_ctrl_c_aborts(tmp_path):
    proc = _start(tmp_path, save_s=120.0)
    _ready(tmp_path, proc)
    proc.send_signal(signal.SIGINT)
    while not all((tmp_path / f"rank{r}.txt").exists() for r in (0, 1)):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, out
    assert "aborting without saving" in out


_ONE = """
import json, os
from ftcore.config.schema import compose
from ftcore.runtime import dist as rdist
from tests.support.procs import listening
rdist.init_distributed(compose(["+exp=tiny_full", "launcher.threads_per_rank=1"]))
print(json.dumps(listening(os.getpid())), flush=True)
"""


def test_a_one_process_run_listens_on_loopback_only():
    """issue 51 item 5: a one-process run has no TCP store at all (it had torch's TCPStore,
    listening on `::`, every interface, unauthenticated), and gloo's socket is on the loopback
    address. (The 2-worker launcher's store and its workers' sockets: read while a run is live in
    tests/multiproc/test_resume_kill.py::test_kills_then_stop_requests_tp2.)"""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = str(ROOT)
    one = subprocess.run([sys.executable, "-c", _ONE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    listens = json.loads(one.stdout.strip().splitlines()[-1])
    assert all(addr.startswith("127.") for addr, _ in listens), listens
