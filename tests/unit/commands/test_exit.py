"""How an entry point's process ends (ftcore/cli.py `run`): without Python's teardown of every
module, but with what a normal exit does for the run: the exit status, non-daemon threads joined,
atexit handlers run, logging shut down (buffered records written), stdout's buffer flushed; and
without importing wandb or bitsandbytes unless the config uses them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

PROBE = r"""
import atexit, logging, logging.handlers, sys, threading, time
from pathlib import Path
from ftcore.cli import run
from ftcore.errors import FtcoreError

out, status = Path(sys.argv.pop(1)), int(sys.argv.pop(1))

def task(cfg):
    unused = [m for m in ("wandb", "bitsandbytes") if m in sys.modules and sys.modules[m] is None]
    sys.stdout.write("skipped:" + ",".join(unused))  # no newline: it stays in the buffer
    # written only when flushed: at logging.shutdown (an atexit handler) or at 1000 records
    held = logging.handlers.MemoryHandler(1000, target=logging.FileHandler(out / "log.txt"))
    logging.getLogger("probe").addHandler(held)
    logging.getLogger("probe").warning("logged")

    def late():
        time.sleep(0.5)
        (out / "thread.txt").write_text("joined")

    threading.Thread(target=late).start()
    atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
    if status == 2:
        raise FtcoreError("bad value", field="probe.field")
    return status

run("train", task)
"""


@pytest.mark.parametrize(
    "status,overrides,skipped",
    [
        (0, [], "wandb,bitsandbytes"),
        (3, ["logger.wandb.mode=offline", "peft=qlora"], ""),
        (2, ["peft=lora"], "wandb,bitsandbytes"),
    ],
    ids=["done", "requeue_with_wandb_and_qlora", "user_error"],
)
def test_exit_keeps_the_status_and_what_a_normal_exit_does(status, overrides, skipped, tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), str(status), *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == status, proc.stderr[-3000:]
    assert proc.stdout == f"skipped:{skipped}", proc.stderr[-3000:]
    assert (tmp_path / "log.txt").read_text() == "logged\n"
    assert (tmp_path / "thread.txt").read_text() == "joined"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    if status == 2:
        assert "ftcore error: probe.field: bad value" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_profiled_run_exits_the_usual_way_and_writes_its_profile(tmp_path):
    """cProfile (as coverage or a debugger) reports after the program returns: no early exit."""
    script, prof = tmp_path / "probe.py", tmp_path / "run.prof"
    script.write_text(PROBE)
    proc = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), str(script),
                           str(tmp_path), "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # (cProfile drops the status)
    assert prof.stat().st_size > 0
    assert (tmp_path / "atexit.txt").read_text() == "ran"
