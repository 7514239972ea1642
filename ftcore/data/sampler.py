"""The global order of rows, deterministic from the seed and independent of the data-parallel size.

Epoch e is a list of rows (each a list of document ids): the documents of the epoch (the weighted
mix of the sources) shuffled from (seed, e), packed or one per row, and the rows shuffled again
from (seed, e). The run reads this as one endless stream of rows; global batch k is rows
[k·G, (k+1)·G) of the stream (crossing into the next epoch when one runs out), and DP rank r takes
its contiguous slice of it. The position in the stream, (epoch, index), is the whole resume state,
so a resumed run, at any DP size, sees exactly the rows the uninterrupted run would have seen.
"""

from __future__ import annotations

import math

import numpy as np

from ftcore.data.packing import pack


def rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *keys])))


class Sampler:
    """Rows of the endless stream; `sizes[i]` documents per source, `lengths` of every document."""

    def __init__(
        self,
        sources: list[np.ndarray],
        counts: list[int],
        lengths: np.ndarray,
        seq_len: int,
        packing: bool,
        seed: int,
    ):
        self.sources = sources  # document ids of each source
        self.counts = counts  # documents drawn from each source per epoch (the mix weights)
        self.lengths, self.seq_len, self.packing, self.seed = lengths, seq_len, packing, seed
        self.epoch, self.index = 0, 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def epoch_docs(self, epoch: int) -> np.ndarray:
        """This epoch's document ids: each source's share, cycling through its own permutations."""
        picked = []
        for s, (ids, count) in enumerate(zip(self.sources, self.counts)):
            start, n = epoch * count, len(ids)
            c0, c1 = start // n, (start + count - 1) // n if count else start // n
            cycle = np.concatenate(
                [ids[rng(self.seed, 1, s, c).permutation(n)] for c in range(c0, c1 + 1)]
            )
            picked.append(cycle[start - c0 * n : start - c0 * n + count])
        docs = np.concatenate(picked) if picked else np.zeros(0, np.int64)
        return docs[rng(self.seed, 2, epoch).permutation(len(docs))]

    def rows(self, epoch: int) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        docs = self.epoch_docs(epoch)
        if self.packing:
            bins = pack([int(self.lengths[d]) for d in docs], self.seq_len)
            rows = [[int(docs[i]) for i in b] for b in bins]
            rows = [rows[i] for i in rng(self.seed, 3, epoch).permutation(len(rows))]
        else:
            rows = [[int(d)] for d in docs]
        self._cache = (epoch, rows)
        return rows

    def end_of(self, epochs: float) -> tuple[int, int]:
        """The stream position (epoch, index) after `epochs` passes over the data (a fraction of
        the last epoch's rows, rounded up)."""
        whole = int(epochs)
        index = math.ceil((epochs - whole) * len(self.rows(whole))) if epochs > whole else 0
        return whole, index

    def rows_before(self, end: tuple[int, int]) -> int:
        """Rows of the stream from its start up to the position `end`."""
        return sum(len(self.rows(e)) for e in range(end[0])) + end[1]

    def take(self, n: int, end: tuple[int, int] | None = None) -> list[list[int]]:
        """The next n rows of the stream (advances the position); past `end` (train.epochs), empty
        rows: all padding, no targets, so the last step covers what is left of the last epoch."""
        out: list[list[int]] = []
        while len(out) < n:
            if end is not None and (self.epoch, self.index) >= end:
                return out + [[] for _ in range(n - len(out))]
            if end is not None and self.epoch == end[0]:
                k = min(n - len(out), end[1] - self.index)
                out += self.rows(self.epoch)[self.index : self.index + k]
                self.index += k
                continue
            rows = self.rows(self.epoch)
            if not rows:
                raise RuntimeError("an epoch without rows")
            k = min(n - len(out), len(rows) - self.index)
            out += rows[self.index : self.index + k]
            self.index += k
            if self.index == len(rows):
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, d: dict) -> None:
        self.epoch, self.index = int(d["epoch"]), int(d["index"])
