"""What both sides of bench/cpu_vs_hf share: the optimizer steps' documents and the timed span.

Step groups: ftcore's own loader (ftcore.data.pipeline.build_train_loader, its sampler's order,
packing and shuffle) says which documents make up each optimizer step of the epoch; the HF recipe
is given exactly those groups, and both sides record a digest of what they trained on, so a pair
that did not see the same documents in the same steps is refused (ftcore.bench.pairs).

Timed span: both sides mark the end of every optimizer step (wall via perf_counter, CPU via
process_time, and the time waited for turns so far); a run is timed from the end of step W
(bench.warmup_steps) to the end of its last step, less the turns waited in between.
"""

from __future__ import annotations

import hashlib
import json
import math
import time

from ftcore.errors import FtcoreError


def epoch_steps(rows: int, global_batch: int) -> int:
    """Optimizer steps of one epoch of `rows` rows (the last step may reach into the next)."""
    return max(1, math.ceil(rows / global_batch))


def check_warmup(steps: int, warmup: int) -> None:
    if warmup >= steps:
        raise FtcoreError(f"the epoch has {steps} optimizer steps, not more than "
                          f"bench.warmup_steps={warmup}: nothing would be timed",
                          field="bench.warmup_steps",
                          fix="fewer warm-up steps, or more data (data.max_samples)")  # fmt: skip


def step_groups(loader, steps: int) -> list[list[int]]:
    """The document ids of each of the first `steps` optimizer steps of a fresh loader (one DP
    rank: the whole global batch), rows in order; advances the loader."""
    return [[d for row in loader.next_rows() for d in row] for _ in range(steps)]


def record_groups(loader) -> list[list[int]]:
    """From now on, the document ids of every global batch the loader hands out, appended to the
    returned list (the trainer's own calls: nothing else changes)."""
    seen: list[list[int]] = []
    take = loader.next_rows

    def next_rows():
        rows = take()
        seen.append([d for row in rows for d in row])
        return rows

    loader.next_rows = next_rows
    return seen


def digest(groups: list[list[int]]) -> str:
    """A short fingerprint of the step groups (order of steps and of documents within a step)."""
    return hashlib.sha256(json.dumps(groups).encode()).hexdigest()[:16]


class StepClock:
    """Marks at the start (mark 0) and at the end of every optimizer step (mark k: step k)."""

    def __init__(self, turn=None):
        self.turn, self.marks = turn, []

    def mark(self, *_) -> None:
        t = self.turn
        waited = (t.waited_s, t.waited_cpu_s) if t is not None else (0.0, 0.0)
        self.marks.append((time.perf_counter(), time.process_time(), *waited))

    def span(self, warmup: int) -> dict:
        """From the end of step `warmup` to the end of the last step: wall and CPU seconds, both
        less the turns waited for (a waiting process's other threads, e.g. gloo's, still use
        some CPU: cpu_waited_s, left out), and the number of steps."""
        (w0, c0, t0, u0), (w1, c1, t1, u1) = self.marks[warmup], self.marks[-1]
        return {"wall_s": (w1 - w0) - (t1 - t0), "cpu_s": (c1 - c0) - (u1 - u0),
                "waited_s": t1 - t0, "cpu_waited_s": u1 - u0,
                "measured_steps": len(self.marks) - 1 - warmup}  # fmt: skip
