"""bench.turns: a round's processes alive at once, computing one at a time (ftcore/turns.py).
Real processes and pipes; each worker logs when its steps ran."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ftcore.bench import turns

WORKER = """
import sys, time
from ftcore.bench.turns import Turn
name, steps, crash_after, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
turn = Turn.from_env()
turn.start(steps)
for i in range(steps):
    t0 = time.monotonic(); time.sleep(0.02); t1 = time.monotonic()
    with open(log, "a") as f:
        f.write(f"{name} {i} {t0} {t1}\\n")
    if i + 1 == crash_after:
        sys.exit(3)
    turn.after_step()
print(name, "waited", turn.waited_s)
"""


def _start(name: str, steps: int, log, slices: int, crash_after: int = 0):
    cmd = [sys.executable, "-c", WORKER, name, str(steps), str(crash_after), str(log)]
    return lambda: turns.spawn(cmd, {**__import__("os").environ}, subprocess.DEVNULL, slices)


def _ran(log) -> list[tuple[str, float, float]]:
    rows = [line.split() for line in log.read_text().splitlines()]
    return sorted((n, float(t0), float(t1)) for n, _, t0, t1 in rows)


def test_slices_alternate_and_never_overlap(tmp_path):
    log = tmp_path / "steps.log"
    starts = [_start("a", 6, log, 3), _start("b", 3, log, 3), _start("c", 6, log, 2)]
    assert turns.take_turns(starts, timeout_s=60) == [0, 0, 0]
    ran = sorted(_ran(log), key=lambda r: r[1])
    # a: 2 steps a slice, b: 1, c: 3 (its 6 steps in 2 slices); each starts on spawn
    order = "".join(n for n, _, _ in ran)
    assert order == "aabcccaabcccaab"
    for (_, _, end), (_, start, _) in zip(ran, ran[1:]):
        assert start >= end  # one process computes at a time


def test_a_worker_that_dies_leaves_the_round_running(tmp_path):
    log = tmp_path / "steps.log"
    starts = [_start("a", 4, log, 4), _start("b", 4, log, 4, crash_after=2)]
    assert turns.take_turns(starts, timeout_s=60) == [0, 3]
    assert [n for n, *_ in _ran(log)].count("a") == 4


def test_a_hung_worker_is_killed_at_the_deadline(tmp_path):
    log = tmp_path / "steps.log"
    hung = [sys.executable, "-c", "import time; time.sleep(600)"]
    starts = [_start("a", 2, log, 2), lambda: turns.spawn(hung, {}, subprocess.DEVNULL, 2)]
    t0 = time.monotonic()
    assert turns.take_turns(starts, timeout_s=3) == ["timeout", "timeout"]  # one deadline
    assert time.monotonic() - t0 < 30


def test_without_the_runner_there_is_no_turn(monkeypatch):
    monkeypatch.delenv(turns.TURN_ENV, raising=False)
    assert turns.Turn.from_env() is None


def test_a_run_of_several_processes_cannot_take_turns(tmp_path):
    from ftcore.bench.runner import Bench
    from ftcore.bench.vs_hf import run_cpu_vs_hf
    from ftcore.config.schema import compose
    from ftcore.errors import FtcoreError

    cfg = compose(["bench=cpu_vs_hf_smoke", f"bench.output_dir={tmp_path}"])
    b = Bench(cfg, ["launcher.nproc_per_node=2"], "python -m ftcore.bench ...")
    with pytest.raises(FtcoreError, match="several processes") as e:
        run_cpu_vs_hf(b)
    assert e.value.field == "bench.turns"
    assert not (tmp_path / "runs").exists()  # nothing started
