"""Take turns: a round's benchmark processes alive side by side, one computing at a time.

This VM's speed drifts by 15-35% over minutes; run back to back, an epoch of one side can land in
a fast stretch and the other's in a slow one, so one round's ratio says as much about the VM as
about the code. With `bench.turns = N` the runner starts every process of a round, and each one
splits its epoch into N slices and hands over after each: slice i of every side runs within the
same few seconds, and each side's timed wall leaves out the time it waited. Cost: one pipe write
and read per hand-over, and caches the other process has just used (measured: see README).

Runner side: `spawn` and `take_turns`. Worker side: `Turn.from_env()`, then `turn.after_step()` after
each training step of the epoch (outside its timed part). The turn is held from the start of the
process to its first hand-over and from the last one to its exit: set-up, eval and export never
overlap another's timed steps.
"""

from __future__ import annotations

import math
import os
import select
import subprocess
import time

TURN_ENV = "FTCORE_BENCH_TURN"  # "<read fd>,<write fd>,<slices>" of a worker's two pipe ends


class Turn:
    """A worker's end: hands the turn back every `per_slice` steps and waits to get it again."""

    def __init__(self, read_fd: int, write_fd: int, slices: int):
        self.read_fd, self.write_fd, self.slices = read_fd, write_fd, slices
        self.per_slice, self.steps, self.waited_s = 1, 0, 0.0
        self.waited_cpu_s = 0.0  # CPU seconds the process spent while waiting (other threads)

    @classmethod
    def from_env(cls) -> Turn | None:
        spec = os.environ.get(TURN_ENV)
        if not spec:
            return None
        r, w, n = (int(x) for x in spec.split(","))
        return cls(r, w, n)

    def start(self, total_steps: int) -> None:
        """The epoch has total_steps steps: hand over after every ceil(total / slices)."""
        self.per_slice = max(1, math.ceil(total_steps / max(1, self.slices)))

    def after_step(self) -> None:
        """Hand over at a slice's end and wait for the turn; the wait adds to waited_s."""
        self.steps += 1
        if self.steps % self.per_slice:
            return
        t0, c0 = time.perf_counter(), time.process_time()
        os.write(self.write_fd, b"y")
        if os.read(self.read_fd, 1) != b"g":
            raise RuntimeError("the benchmark runner went away")
        self.waited_s += time.perf_counter() - t0
        self.waited_cpu_s += time.process_time() - c0


def spawn(cmd: list[str], env: dict, log_file, slices: int) -> tuple[subprocess.Popen, int, int]:
    """Start a worker that takes turns; returns (process, fd the runner reads, fd it writes)."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    env = {**env, TURN_ENV: f"{to_child_r},{from_child_w},{slices}"}
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                            pass_fds=(to_child_r, from_child_w))  # fmt: skip
    os.close(to_child_r)
    os.close(from_child_w)
    return proc, from_child_r, to_child_w


def _wait_hand_over(fd: int, proc: subprocess.Popen, deadline: float) -> bool:
    """True when the worker handed the turn over, False when it exited (its pipe closed)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        ready, _, _ = select.select([fd], [], [], min(left, 5.0))
        if ready:
            return os.read(fd, 1) == b"y"
        if proc.poll() is not None and not select.select([fd], [], [], 0)[0]:
            return False


def take_turns(starts: list, timeout_s: float) -> list:
    """starts: callables that each spawn one worker (see `spawn`). Start them one at a time (each
    holds the turn through its set-up), then hand the turn round until every one has exited.
    Returns each worker's exit code, or "timeout" (the whole round shares timeout_s)."""
    deadline = time.monotonic() + timeout_s
    workers, codes = [], [None] * len(starts)
    try:
        for i, start in enumerate(starts):
            proc, rfd, wfd = start()
            workers.append((i, proc, rfd, wfd))
            if not _wait_hand_over(rfd, proc, deadline):
                codes[i] = _retire(*workers.pop()[1:])
        while workers:
            for entry in list(workers):
                i, proc, rfd, wfd = entry
                if not _hand_to(wfd) or not _wait_hand_over(rfd, proc, deadline):
                    workers.remove(entry)
                    codes[i] = _retire(proc, rfd, wfd)
    except TimeoutError:
        for i, proc, rfd, wfd in workers:
            proc.kill()
            _retire(proc, rfd, wfd)
            codes[i] = "timeout"
    return codes


def _hand_to(fd: int) -> bool:
    try:
        os.write(fd, b"g")
        return True
    except BrokenPipeError:  # it died while waiting for its turn
        return False


def _retire(proc: subprocess.Popen, rfd: int, wfd: int) -> int:
    """Close the runner's ends of a worker's pipes; its exit code."""
    for fd in (rfd, wfd):
        try:
            os.close(fd)
        except OSError:
            pass
    return proc.wait()
