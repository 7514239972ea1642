"""Rows of documents -> micro-batch tensors; packing into rows (FFD or most-documents-first).

A row holds one document (unpacked) or several (packed). Inside a row each document keeps its own
positions (restarting at 0), its own segment id (1, 2, ...; 0 is padding), and its labels never
cross into the next document: the last token of a document predicts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from ftcore.data.templates import Doc


@dataclass
class MicroBatch:
    """One micro-batch on the CPU: [micro_batch_size, width] tensors (width: data.seq_len, or
    less for trimmed unpacked rows, ftcore.data.pipeline.trim_multiple)."""

    tokens: torch.Tensor  # int64 input ids (pad id where padding)
    labels: torch.Tensor  # int64, labels[i, t] = token after position t; 0 where not a target
    loss_mask: torch.Tensor  # float32, 1.0 where labels[i, t] is a target
    position_ids: torch.Tensor  # int64, restart at 0 for each packed document
    segment_ids: torch.Tensor  # int32, document index within the row (1, 2, ...); 0 = padding
    num_tokens: int  # non-padding tokens
    # THD layout of the rows (cu_seqlens_from_segments), computed once here on the host: the
    # forward step of every virtual pipeline stage reads it, and a Python int needs no device sync
    cu_seqlens: torch.Tensor | None = None  # int32 [documents + 1]
    max_seqlen: int = 0
    # packed rows under CP (make_microbatch's doc_multiple > 1): the boundaries of the documents
    # padded to the multiple (TE's cu_seqlens_padded), cu_seqlens then counts real tokens only
    cu_seqlens_padded: torch.Tensor | None = None
    # Preference pairs (data.format=preference, data/samples.py), else None. Per token and aligned
    # with labels/loss_mask (position t describes the target labels[i, t]): pair_index is the
    # pair of this micro-batch (0 ... num_pairs-1) whose completion that target belongs to, -1
    # exactly where loss_mask is 0 (prompt, padding, a document's last token); pair_side is 0
    # for the chosen completion, 1 for the rejected one, -1 where pair_index is. A pair's two
    # documents are always in the same micro-batch (unpacked: rows 2k and 2k+1; packed: one row).
    # CP slices them with the tokens (data/cp.py); a pair's log-prob is the sum over its targets.
    pair_index: torch.Tensor | None = None  # int64 [b, width]
    pair_side: torch.Tensor | None = None  # int64 [b, width]
    num_pairs: int = 0
    # the sample ids (positions in the data's pair table) of pairs 0 ... num_pairs-1: what a
    # stored reference log-prob is keyed by (objective.precompute_ref, training/objectives/dpo/ref_store.py)
    pair_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.cu_seqlens is None:
            self.cu_seqlens, self.max_seqlen = cu_seqlens_from_segments(self.segment_ids)

    @property
    def num_target_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def pin_memory(self) -> MicroBatch:
        """The same micro-batch in pinned host memory, so copies to the GPU can be asynchronous
        (ftcore.data.transfer); needs CUDA."""
        pinned = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in pinned.items():
            if isinstance(v, torch.Tensor):
                pinned[k] = v.pin_memory()
        return MicroBatch(**pinned)


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) from first-fit-decreasing; ties keep the input order.

    A max segment tree over the bins' free space finds the first bin that fits in O(log n).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    free = [0] * (
        2 * size
    )  # leaves: free space of bin j at size + j; unopened bins are full capacity
    for j in range(size):
        free[size + j] = capacity
    for j in range(size - 1, 0, -1):
        free[j] = max(free[2 * j], free[2 * j + 1])
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"item {i} of length {n} exceeds the capacity {capacity}")
        j = 1
        while j < size:  # descend to the leftmost leaf with enough room
            j = 2 * j if free[2 * j] >= n else 2 * j + 1
        b = j - size
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        free[j] -= n
        j //= 2
        while j:
            free[j] = max(free[2 * j], free[2 * j + 1])
            j //= 2
    return bins


def most_documents_first(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) that first fit as many documents as they can.

    FFD fills a row with the longest documents first; on lengths that vary little (20..30 in
    rows of 128) that leaves rows of four long documents and a gap nothing fits. Here each row
    (a) opens with the longest remaining item, (b) takes the most further items that fit, the
    shortest ones, then (c) from the longest of those down, swaps each for the longest remaining
    item that still fits (so short items stay for later rows). Items of one length are used in
    input order; a bin lists its items longest first.

    Per length a list of item indices and how many are used; the lengths that still have items
    live in a bit tree (_bits_*), so each row costs O(log capacity) per distinct length touched.
    """
    by_len: list[list[int]] = [[] for _ in range(capacity + 1)]
    for i, n in enumerate(lengths):
        if not 1 <= n <= capacity:
            raise ValueError(f"item {i} of length {n} is not in [1, capacity {capacity}]")
        by_len[n].append(i)
    used = [0] * (capacity + 1)  # by_len[n][:used[n]] are placed; the rest are available
    tree = _bits_new(capacity + 1)
    for n in range(1, capacity + 1):
        if by_len[n]:
            _bits_set(tree, n)

    def take(n: int, k: int = 1) -> None:
        used[n] += k
        if used[n] == len(by_len[n]):
            _bits_clear(tree, n)

    def put_back(n: int) -> None:  # the last item taken of length n
        if used[n] == len(by_len[n]):
            _bits_set(tree, n)
        used[n] -= 1

    bins: list[list[int]] = []
    while (top := _bits_prev(tree, capacity)) > 0:
        take(top)  # (a)
        space = capacity - top
        chosen = []  # (b): (length, count), shortest first
        n = _bits_next(tree, 1)
        while 0 < n <= space:
            k = min(len(by_len[n]) - used[n], space // n)
            take(n, k)
            chosen.append((n, k))
            space -= n * k
            if used[n] < len(by_len[n]):
                break  # the next item of this length does not fit, nor does any longer one
            n = _bits_next(tree, n + 1)
        count = {top: 1}
        for n, k in reversed(chosen):  # (c); `space` is the slack
            while k:
                best = _bits_prev(tree, n + space)
                if best <= n:  # nothing longer fits: keep this and the rest of this length
                    count[n] = count.get(n, 0) + k
                    break
                put_back(n)
                take(best)
                count[best] = count.get(best, 0) + 1
                space -= best - n
                k -= 1
        parts = [by_len[n][used[n] - count[n] : used[n]] for n in sorted(count, reverse=True)]
        bins.append([i for part in parts for i in part])  # this row took the last items used
    return bins


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins for packed rows: the fewer of first_fit_decreasing's and most_documents_first's
    (FFD's on a tie). Neither wins on every length distribution, both are fast, and fewer rows
    are fewer steps for the same tokens."""
    ffd = first_fit_decreasing(lengths, capacity)
    mdf = most_documents_first(lengths, capacity)
    return mdf if len(mdf) < len(ffd) else ffd


def _bits_new(size: int) -> list[list[int]]:
    """An empty set of integers in [0, size): levels of 64-bit words, level 0 has bit x % 64 of
    word x // 64 for each member x, and bit b of word w on level j + 1 says word 64 w + b on
    level j is not zero. Finding a neighbour or updating looks at one word per level."""
    levels = []
    while True:
        size = (size + 63) // 64
        levels.append([0] * size)
        if size == 1:
            return levels


def _bits_set(levels: list[list[int]], x: int) -> None:
    for words in levels:
        w, was = x >> 6, words[x >> 6]
        words[w] = was | (1 << (x & 63))
        if was:
            return
        x = w


def _bits_clear(levels: list[list[int]], x: int) -> None:
    for words in levels:
        w = x >> 6
        words[w] &= ~(1 << (x & 63))
        if words[w]:
            return
        x = w


def _bits_prev(levels: list[list[int]], x: int) -> int:
    """The largest member <= x, or -1."""
    for j, words in enumerate(levels):
        if x < 0:
            return -1
        w = x >> 6
        below = words[w] & ((2 << (x & 63)) - 1)
        if below:
            x = (w << 6) + below.bit_length() - 1
            for lower in reversed(levels[:j]):  # down again, the highest bit on each level
                x = (x << 6) + lower[x].bit_length() - 1
            return x
        x = w - 1
    return -1


def _bits_next(levels: list[list[int]], x: int) -> int:
    """The smallest member >= x, or -1."""
    for j, words in enumerate(levels):
        w = x >> 6
        if w >= len(words):
            return -1
        above = words[w] >> (x & 63) << (x & 63)
        if above:
            x = (w << 6) + (above & -above).bit_length() - 1
            for lower in reversed(levels[:j]):  # down again, the lowest bit on each level
                v = lower[x]
                x = (x << 6) + (v & -v).bit_length() - 1
            return x
        x = w + 1
    return -1


def padded_length(n: int, doc_multiple: int) -> int:
    return -(-n // doc_multiple) * doc_multiple


def make_microbatch(
    rows: list[list[Doc]],
    seq_len: int,
    pad_id: int,
    doc_multiple: int = 1,
    pairs: list[list[tuple[int, int]]] | None = None,
    pair_ids: tuple[int, ...] | None = None,
) -> MicroBatch:
    """Tensors for rows of documents (an empty row is all padding).

    doc_multiple > 1 (packed rows under context parallelism: 2*cp) pads every document to a
    multiple of it, as TE's THD partitioning needs: the pad tokens follow the document's own
    tokens with its segment id and continuing positions, no loss and no labels, so (causally) no
    real token attends them and they never reach another document. `pairs`: each document's
    (pair, side) for preference data (MicroBatch.pair_index), `pair_ids` their sample ids."""
    b = len(rows)
    tokens = np.full((b, seq_len), pad_id, np.int64)
    labels = np.zeros((b, seq_len), np.int64)
    loss_mask = np.zeros((b, seq_len), np.float32)
    position_ids = np.zeros((b, seq_len), np.int64)
    segment_ids = np.zeros((b, seq_len), np.int32)
    pair_index = np.full((b, seq_len), -1, np.int64) if pairs is not None else None
    pair_side = np.full((b, seq_len), -1, np.int64) if pairs is not None else None
    real, padded = [0], [0]  # cumulative lengths, for doc_multiple > 1
    for r, docs in enumerate(rows):
        t = 0
        for k, d in enumerate(docs, start=1):
            n = len(d)
            m = padded_length(n, doc_multiple)
            if t + m > seq_len:
                raise ValueError(f"row {r} overflows seq_len {seq_len}")
            tokens[r, t : t + n] = d.ids
            labels[r, t : t + n - 1] = np.where(d.targets[1:], d.ids[1:], 0)
            loss_mask[r, t : t + n - 1] = d.targets[1:]
            if pairs is not None:
                p, side = pairs[r][k - 1]
                pair_index[r, t : t + n - 1] = np.where(d.targets[1:], p, -1)
                pair_side[r, t : t + n - 1] = np.where(d.targets[1:], side, -1)
            position_ids[r, t : t + m] = np.arange(m)
            segment_ids[r, t : t + m] = k
            real.append(real[-1] + n)
            padded.append(padded[-1] + m)
            t += m
        if t < seq_len:  # the row's padding: one more sequence, as cu_seqlens_from_segments has it
            real.append(real[-1] + seq_len - t)
            padded.append(padded[-1] + seq_len - t)
    extra = {}
    if pairs is not None:
        extra["pair_index"] = torch.from_numpy(pair_index)
        extra["pair_side"] = torch.from_numpy(pair_side)
        extra["num_pairs"] = len({p for tags in pairs for p, _ in tags})
        extra["pair_ids"] = pair_ids
    if doc_multiple > 1:
        extra |= {
            "cu_seqlens": torch.tensor(real, dtype=torch.int32),
            "cu_seqlens_padded": torch.tensor(padded, dtype=torch.int32),
            "max_seqlen": int(np.diff(padded).max()) if len(padded) > 1 else 0,
        }
    return MicroBatch(
        tokens=torch.from_numpy(tokens),
        labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(loss_mask),
        position_ids=torch.from_numpy(position_ids),
        segment_ids=torch.from_numpy(segment_ids),
        num_tokens=sum(len(d) for docs in rows for d in docs),
        **extra,
    )


def real_tokens(mb: MicroBatch) -> torch.Tensor:
    """bool [b, s]: the documents' own tokens, False for padding: the rows' ends (segment 0) and,
    in rows packed under CP, the pads that follow each document with its segment id (the gaps
    between `cu_seqlens` and `cu_seqlens_padded`). What a MoE router counts (docs/moe.md)."""
    real = mb.segment_ids > 0
    if mb.cu_seqlens_padded is None:
        return real
    flat = real.reshape(-1).clone()
    lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
    for start, end, n in zip(
        mb.cu_seqlens_padded[:-1].tolist(), mb.cu_seqlens_padded[1:].tolist(), lengths
    ):
        flat[start + n : end] = False
    return flat.reshape(real.shape)


def attention_mask_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """bool [b, 1, s, s], True = masked out (megatron's convention).

    Attend only causally within the same document; padding attends to nothing but itself (the
    diagonal stays open so no row is all-masked and softmax stays finite).
    """
    seg = segment_ids.long()
    s = seg.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=seg.device).tril()
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    allowed = same & causal
    allowed |= torch.eye(s, dtype=torch.bool, device=seg.device)
    return (~allowed).unsqueeze(1)


def cu_seqlens_from_segments(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """THD layout for TE's fused attention: cumulative lengths (int32) of the documents of the
    flattened batch, each row's padding counted as one more sequence; and the longest length.

    A sequence starts at the first position of each row and wherever the segment id changes, so
    cu_seqlens is those start offsets in the flattened [b * s] order followed by b * s: array
    operations on the host, no loop over tokens."""
    seg = np.asarray(segment_ids)
    if seg.size == 0:
        return torch.zeros(1, dtype=torch.int32), 0
    starts = np.ones(seg.shape, dtype=bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    cu = np.append(np.flatnonzero(starts), seg.size).astype(np.int32)
    return torch.from_numpy(cu), int(np.diff(cu).max())


def microbatch_iterators(microbatches: list[MicroBatch], num_chunks: int):
    """megatron's schedule wants one iterator per virtual stage, each over the same micro-batches
    (training's step and generation's forward feed it the same way)."""
    its = [iter(microbatches) for _ in range(num_chunks)]
    return its if num_chunks > 1 else its[0]
