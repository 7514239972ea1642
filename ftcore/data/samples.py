"""Samples through truncation and into rows, whole: a sample is one document, or for preference
data (data/preference.py) a pair of two, chosen then rejected.

Everything that counts or orders data works on samples: the held-out split, the sampler's stream
(so train.global_batch_size, micro_batch_size, epochs and the resume position count pairs), the
DP shards and micro-batches. Only when a micro-batch is made are a pair's two documents laid out:
unpacked, each in its own row (chosen, then rejected, next to each other); packed, both in the
same row, each its own packed document. So a pair is never split across rows, micro-batches or
ranks, and its documents never see each other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ftcore.data.templates import Doc
from ftcore.data.tokenized import DocTable, Tokenized

log = logging.getLogger("ftcore")


@dataclass
class Docs:
    """The documents a loader draws from, after truncation, and what happened on the way. Sample
    i is documents group*i ... group*i + group - 1."""

    docs: DocTable | list[Doc] = field(default_factory=DocTable)
    source_ids: list[np.ndarray] = field(default_factory=list)  # sample ids of each source
    truncated: int = 0  # samples with a document cut to data.seq_len
    dropped: int = 0  # samples dropped: too long (data.truncate=drop), or nothing left to learn
    bad_records: int = 0
    group: int = 1  # documents per sample: 2 for preference pairs
    # the first dropped samples of each source: (sample number in its source, 0-based, why)
    drop_examples: list[tuple[int, str]] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return len(self.docs) // self.group


def truncate(
    docs: Docs,
    tok: Tokenized,
    picks: np.ndarray,
    seq_len: int,
    policy: str,
    fits: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Append the picked samples of one source to `docs`; return their sample ids there. Reads the
    tokens of the over-long documents only (a truncated one must keep a target); a sample goes
    whole or not at all. `fits`: [samples, group] lengths -> whether each sample fits one row
    (packed pairs), else dropped."""
    g = docs.group = tok.group
    picks = np.asarray(picks, np.int64)
    doc_ids = (picks[:, None] * g + np.arange(g)).ravel()
    start = np.asarray(tok.offsets[doc_ids], np.int64)
    lengths = np.asarray(tok.offsets[doc_ids + 1], np.int64) - start
    learn = tok.doc_learn(doc_ids)
    keep, cut = np.ones(len(doc_ids), bool), np.zeros(len(doc_ids), bool)
    why: dict[int, str] = {}  # sample -> the rule that dropped it (the first few are named)
    for j in np.flatnonzero(lengths > seq_len):
        a = int(start[j])
        n = np.count_nonzero(tok.targets[a + 1 : a + seq_len]) if policy != "drop" else 0
        if n == 0:  # dropped, or nothing left to learn from (a prompt filling seq_len)
            keep[j] = False
            what = ("chosen", "rejected")[j % 2] + " sequence" if g == 2 else "sample"
            if len(why) < 3:
                why.setdefault(j // g, f"its {what} has {lengths[j]} tokens, over data.seq_len={seq_len} "
                               "(data.truncate=drop)" if policy == "drop" else
                               f"its prompt fills data.seq_len={seq_len}: no {what.split()[0]} "
                               "token is left to learn from")  # fmt: skip
            continue
        lengths[j], learn[j], cut[j] = seq_len, n, True
    whole = keep.reshape(-1, g).all(1)
    if fits is not None and len(whole):
        fit = fits(lengths.reshape(-1, g))
        for i in np.flatnonzero(whole & ~fit)[:3]:
            pair = lengths.reshape(-1, g)[i]
            why[int(i)] = (f"packed, its sequences of {' + '.join(map(str, pair))} tokens (each rounded up "
                           f"to data.pack_multiple) do not fit one row of data.seq_len={seq_len}")  # fmt: skip
        whole &= fit
    docs.drop_examples += [(int(picks[i]), why[i]) for i in sorted(why)[:3]]
    docs.dropped += int((~whole).sum())
    docs.truncated += int((cut.reshape(-1, g).any(1) & whole).sum())
    mask = np.repeat(whole, g)
    first = docs.samples
    docs.docs.extend(tok, start[mask], lengths[mask], learn[mask])
    return np.arange(first, first + int(whole.sum()), dtype=np.int64)


def per_sample(values: np.ndarray, group: int) -> np.ndarray:
    """A per-document array summed over each sample's documents."""
    return values if group == 1 else values.reshape(-1, group).sum(1)


def doc_lengths(docs) -> np.ndarray:
    if isinstance(docs, DocTable):
        return docs.lengths
    return np.asarray([len(d) for d in docs], np.int64)


def doc_learn(docs) -> np.ndarray:
    """Target tokens after each document's first (what its loss counts)."""
    if isinstance(docs, DocTable):
        return docs.learn
    return np.asarray([int(d.targets[1:].sum()) for d in docs], np.int64)


def doc_rows(
    rows: list[list[int]], group: int, packed: bool
) -> tuple[list[list[int]], list[list[tuple[int, int]]] | None]:
    """One micro-batch's rows of sample ids -> its rows of document ids, and for pairs each
    document's (pair index within the micro-batch, side: 0 chosen, 1 rejected). Unpacked, a
    pair's row becomes two rows (an empty one, two empty rows); packed, the row holds both
    documents of each of its pairs, in order."""
    if group == 1:
        return rows, None
    out: list[list[int]] = []
    tags: list[list[tuple[int, int]]] = []
    p = 0
    for r in rows:
        if packed:
            out.append([group * u + k for u in r for k in range(group)])
            tags.append([(p + i, k) for i in range(len(r)) for k in range(group)])
            p += len(r)
            continue
        if len(r) > 1:
            raise ValueError(f"an unpacked row holds one sample, not {len(r)}")
        for k in range(group):
            out.append([group * r[0] + k] if r else [])
            tags.append([(p, k)] if r else [])
        p += len(r)
    return out, tags


def name_drops(path: str, tok, examples: list[tuple[int, str]]) -> None:
    """Say where the first dropped samples of a source are and which rule dropped them. A sample
    is the source's n-th record when no record was bad (else it is named by its number)."""
    if not examples:
        return
    from ftcore.data import sources

    wheres, wanted = {}, {k for k, _ in examples}
    if tok.bad_records == 0:
        n = 0
        for where, rec in sources.iter_records(sources.resolve(path)):
            if isinstance(rec, sources.RecordError):
                continue
            if n in wanted:
                wheres[n] = where
            n += 1
            if n > max(wanted):
                break
    what = "pair" if tok.group > 1 else "sample"
    for k, why in examples:
        where = wheres.get(k, f"{path}: {what} {k + 1} (counting the good records)")
        log.warning("dropped the %s at %s: %s", what, where, why)
