"""Megatron DDP's contiguous buffer of one rank's trainable parameters, laid out from runs of
identical layers instead of one parameter at a time (a 235B MoE rank has ~10^5 parameters; the
layout search plans hundreds of layouts).

The rules (megatron-core 0.16.1, param_and_grad_buffer.py), replayed exactly: parameters fill the
buffer in reverse registration order; with the distributed optimizer each starts at a multiple of
64 elements (128-byte alignment) and the buffer is padded to a multiple of lcm(dp, 128); rank i
of the data-parallel group owns elements [i*n/dp, (i+1)*n/dp) and keeps optimizer state for the
parameter elements inside it. A block is one layer's (or one non-layer parameter's) trainable
parameters repeated `count` times: every copy starts aligned (its first parameter pads), so each
copy spans the same `stride` and only the copies crossing a shard's edges are walked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALIGN = 64  # megatron param_and_grad_buffer: params start 128-byte aligned (64 values)


def pad(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class Run:
    """`count` consecutive copies of a block; `ranges` are its parameters' (start, end) relative
    to the copy's start, in buffer order."""

    start: int
    count: int
    stride: int
    ranges: tuple[tuple[int, int], ...]
    end: int  # of the last parameter of one copy, relative to its start


def layout(
    blocks: list[tuple[list[int], int]], distributed: bool, dp: int
) -> tuple[list[Run], int]:
    """(runs, padded buffer size) of blocks given in registration order as (element counts of
    the block's parameters in registration order, copies)."""
    runs, pos = [], 0
    for numels, count in reversed(blocks):
        if not numels or not count:
            continue
        ranges, rel = [], 0
        for n in reversed(numels):
            rel = pad(rel, ALIGN) if distributed else rel
            ranges.append((rel, rel + n))
            rel += n
        start = pad(pos, ALIGN) if distributed else pos
        stride = pad(rel, ALIGN) if distributed else rel
        runs.append(Run(start, count, stride, tuple(ranges), rel))
        pos = start + (count - 1) * stride + rel
    size = pad(pos, math.lcm(dp, 128)) if distributed else pos
    return runs, size


def _copy_overlap(run: Run, base: int, lo: int, hi: int) -> tuple[int, int]:
    elems = tensors = 0
    for a, b in run.ranges:
        n = min(b + base, hi) - max(a + base, lo)
        if n > 0:
            elems += n
            tensors += 1
    return elems, tensors


def shard(runs: list[Run], size: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """(parameter elements, parameter tensors) inside dp rank's shard of the buffer."""
    lo, hi = size // dp * dp_rank, size // dp * (dp_rank + 1)
    elems = tensors = 0
    full_elems = lambda r: sum(b - a for a, b in r.ranges)  # noqa: E731
    for r in runs:
        last = r.start + (r.count - 1) * r.stride
        if r.start >= hi or last + r.end <= lo:
            continue
        # copies wholly inside [lo, hi): j from first_in to last_in
        first_in = max(0, -(-(lo - r.start) // r.stride)) if r.stride else 0
        last_in = min(r.count - 1, (hi - r.end - r.start) // r.stride) if r.stride else r.count - 1
        inside = max(0, last_in - first_in + 1)
        elems += inside * full_elems(r)
        tensors += inside * len(r.ranges)
        # the copies at the edges, partly inside
        edges = {j for j in (first_in - 1, last_in + 1, first_in, last_in) if 0 <= j < r.count}
        for j in edges:
            if inside and first_in <= j <= last_in:
                continue
            e, t = _copy_overlap(r, r.start + j * r.stride, lo, hi)
            elems, tensors = elems + e, tensors + t
    return elems, tensors
