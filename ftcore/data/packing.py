"""Rows of documents -> micro-batch tensors; first-fit-decreasing packing of documents into rows.

A row holds one document (unpacked) or several (packed). Inside a row each document keeps its own
positions (restarting at 0), its own segment id (1, 2, ...; 0 is padding), and its labels never
cross into the next document: the last token of a document predicts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def num_target_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


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


def make_microbatch(rows: list[list[Doc]], seq_len: int, pad_id: int) -> MicroBatch:
    """Tensors for rows of documents (an empty row is all padding)."""
    b = len(rows)
    tokens = np.full((b, seq_len), pad_id, np.int64)
    labels = np.zeros((b, seq_len), np.int64)
    loss_mask = np.zeros((b, seq_len), np.float32)
    position_ids = np.zeros((b, seq_len), np.int64)
    segment_ids = np.zeros((b, seq_len), np.int32)
    for r, docs in enumerate(rows):
        t = 0
        for k, d in enumerate(docs, start=1):
            n = len(d)
            if t + n > seq_len:
                raise ValueError(f"row {r} overflows seq_len {seq_len}")
            tokens[r, t : t + n] = d.ids
            labels[r, t : t + n - 1] = np.where(d.targets[1:], d.ids[1:], 0)
            loss_mask[r, t : t + n - 1] = d.targets[1:]
            position_ids[r, t : t + n] = np.arange(n)
            segment_ids[r, t : t + n] = k
            t += n
    return MicroBatch(
        tokens=torch.from_numpy(tokens),
        labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(loss_mask),
        position_ids=torch.from_numpy(position_ids),
        segment_ids=torch.from_numpy(segment_ids),
        num_tokens=int((segment_ids > 0).sum()),
    )


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
    flattened batch, each row's padding counted as one more sequence; and the longest length."""
    lengths = []
    for row in segment_ids.tolist():
        runs, prev = [], None
        for s in row:
            if s == prev:
                runs[-1] += 1
            else:
                runs.append(1)
                prev = s
        lengths += runs
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu, max(lengths, default=0)
