"""Records rendered and tokenized by a pool of worker processes, handed back in record order.

One process tokenizes a few hundred thousand tokens a second (the chat template and the BPE are
CPU-bound Python and Rust), so a multi-GB data set takes an hour in the rank that builds the cache
while the other ranks of the node wait idle. The builder instead fans the records out to one worker
per CPU it may use, in chunks, and writes the documents back in the order the records were read:
the cache entry is the same, byte for byte, as the one-process build (tests check it). At most a
few chunks per worker are in flight, so memory stays bounded whatever the size of the data.

Workers are spawned (not forked: the parent may hold a process group, threads and a tokenizer
whose own thread pool does not survive a fork); each receives the pickled Renderer (tokenizer,
resolved template, masking policy) once. Small data is rendered in-process: spawning costs a few seconds of imports.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor

from ftcore.data import preference
from ftcore.data.templates import BadRecord, Renderer

CHUNK = 64  # records per task: large enough to amortise pickling, small enough to balance
IN_FLIGHT = 4  # tasks queued per worker
AUTO_MIN_BYTES = 32 << 20  # below this, `workers=0` (auto) renders in-process
MAX_AUTO_WORKERS = 32

_renderer: Renderer | None = None  # the worker's own, built once by _init


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def choose_workers(requested: int, data_bytes: int | None) -> int:
    """data.tokenize_workers: 0 = auto (every usable CPU, up to 32, for data of 32 MB or more;
    in-process below that or when the size is unknown), else exactly that many (1 = in-process)."""
    if requested > 0:
        return requested
    if data_bytes is None or data_bytes < AUTO_MIN_BYTES:
        return 1
    return max(1, min(usable_cpus(), MAX_AUTO_WORKERS))


def _init(renderer: Renderer) -> None:
    global _renderer
    _renderer = renderer


def _render(chunk: list[tuple[str, object]]) -> list[tuple[str, object]]:
    return [(where, render_one(_renderer, rec)) for where, rec in chunk]


def render_one(renderer: Renderer, rec) -> object:
    """The record's Doc (a preference record's Pair of two), or the BadRecord / RecordError that
    says why it has none."""
    if isinstance(rec, Exception):
        return rec
    try:
        if renderer.fmt == "preference":
            return preference.pair(renderer, rec)
        return renderer.doc(rec)
    except BadRecord as e:
        return e


def _chunks(records: Iterable, size: int) -> Iterator[list]:
    chunk = []
    for item in records:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def rendered(
    records: Iterable[tuple[str, object]], renderer: Renderer, workers: int
) -> Iterator[tuple[str, object]]:
    """(where, Doc | BadRecord | RecordError) for every record, in order. The consumer may stop
    early (max_samples): the pool is shut down and queued tasks are cancelled."""
    if workers <= 1:
        for where, rec in records:
            yield where, render_one(renderer, rec)
        return
    ctx = mp.get_context("spawn")
    pool = ProcessPoolExecutor(workers, ctx, initializer=_init, initargs=(renderer,))
    try:
        pending: deque = deque()
        for chunk in _chunks(records, CHUNK):
            pending.append(pool.submit(_render, chunk))
            if len(pending) >= workers * IN_FLIGHT:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
