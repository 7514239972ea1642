"""Context parallelism (CP): which positions of every sequence a CP rank holds.

Each sequence is cut into 2*cp equal chunks; CP rank r holds chunks r and 2*cp-1-r, megatron's
load-balanced layout for causal attention (megatron.core.utils.get_batch_on_this_cp_rank: the
early chunks attend few keys, the late ones many, so each rank gets one of each). megatron's
RotaryEmbedding slices its angles the same way (get_pos_emb_on_this_cp_rank), so the rotary
positions of a rank's tokens are their global ones. Tokens, labels, loss mask, position and segment
ids (and a preference batch's pair_index and pair_side) are all sliced with the same index; the
attention mask is built from the whole row first (models/local/cp_attention.py) so causality and
document boundaries follow global positions.

Packed rows under CP (micro-batches made with `cu_seqlens_padded`, every document padded to a
multiple of 2*cp) are split per DOCUMENT instead: each document's 2*cp chunks, rank r keeping
chunks r and 2*cp-1-r of every one, Transformer Engine's THD layout
(`tex.thd_get_partitioned_indices`, which megatron's get_thd_batch_on_this_cp_rank calls). The CPU
uses the same layout, so the CPU parity tests exercise the GPU's token placement.
"""

from __future__ import annotations

import dataclasses

import torch

from ftcore.data.packing import MicroBatch

_SLICED = ("tokens", "labels", "loss_mask", "position_ids", "segment_ids")


def local_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """int64 [seq // cp]: the global positions CP rank `rank` holds, in its local order."""
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} does not divide by 2*cp = {2 * cp}")
    c = seq // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def gathered_positions(seq: int, cp: int) -> torch.Tensor:
    """int64 [seq]: the global position of each row of an all-gather over the CP group (rank 0's
    local positions, then rank 1's, ...)."""
    return torch.cat([local_positions(seq, cp, r) for r in range(cp)])


def document_positions(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """int64 [total // cp]: the positions of one row CP rank `rank` holds when every sequence of
    the row (padded boundaries `cu_seqlens_padded`, 0 ... total) is cut into 2*cp chunks and the
    rank keeps chunks r and 2*cp-1-r of each, in TE's order (thd_get_partitioned_indices: sequence
    by sequence, the early chunk then the late one)."""
    cu = cu_seqlens_padded.long().tolist()
    parts = []
    for start, end in zip(cu[:-1], cu[1:]):
        if (end - start) % (2 * cp):
            raise ValueError(f"sequence length {end - start} does not divide by 2*cp = {2 * cp}")
        if end > start:
            parts.append(local_positions(end - start, cp, rank) + start)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def row_cu_seqlens_padded(mb: MicroBatch, row: int) -> torch.Tensor:
    """Row `row`'s padded boundaries (0 ... width) out of the micro-batch's flattened ones."""
    s = mb.tokens.shape[1]
    cu = mb.cu_seqlens_padded.long()
    return cu[(cu >= row * s) & (cu <= (row + 1) * s)] - row * s


def row_positions(mb: MicroBatch, cp: int, rank: int) -> torch.Tensor:
    """int64 [b, s // cp]: the positions of each row this rank holds (per document for packed
    rows made under CP, else the whole-row chunks)."""
    b, s = mb.tokens.shape
    if mb.cu_seqlens_padded is None:
        return local_positions(s, cp, rank).expand(b, -1)
    return torch.stack(
        [document_positions(row_cu_seqlens_padded(mb, i), cp, rank) for i in range(b)]
    )


def gathered_row_positions(mb: MicroBatch, cp: int) -> torch.Tensor:
    """int64 [b, s]: the position of each row of an all-gather over the CP group, per row."""
    return torch.cat([row_positions(mb, cp, r) for r in range(cp)], dim=1)


def shard(mb: MicroBatch, cp: int, rank: int, pin: bool = False) -> MicroBatch:
    """This CP rank's part of a micro-batch ([b, s] -> [b, s // cp] for the sliced fields). The
    documents' cu_seqlens stay those of the whole rows (what the attention's mask is built from).
    `pin` (a CUDA run: training/step.py): the slices in pinned memory like the batch, so their
    non-blocking copies to the device are asynchronous instead of staged through pageable memory."""
    if cp == 1:
        return mb
    index = row_positions(mb, cp, rank)
    names = _SLICED + (("pair_index", "pair_side") if mb.pair_index is not None else ())
    sliced = {name: getattr(mb, name).gather(1, index) for name in names}
    if pin:
        sliced = {name: t.pin_memory() for name, t in sliced.items()}
    return dataclasses.replace(mb, **sliced)
