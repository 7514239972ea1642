"""Context parallelism (CP): which positions of every sequence a CP rank holds.

Each sequence is cut into 2*cp equal chunks; CP rank r holds chunks r and 2*cp-1-r, megatron's
load-balanced layout for causal attention (megatron.core.utils.get_batch_on_this_cp_rank: the
early chunks attend few keys, the late ones many, so each rank gets one of each). megatron's
RotaryEmbedding slices its angles the same way (get_pos_emb_on_this_cp_rank), so the rotary
positions of a rank's tokens are their global ones. Tokens, labels, loss mask, position and segment
ids are all sliced with the same index; the attention mask is built from the whole row first
(models/local/cp_attention.py) so causality and document boundaries follow global positions.
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


def shard(mb: MicroBatch, cp: int, rank: int) -> MicroBatch:
    """This CP rank's part of a micro-batch ([b, s] -> [b, s // cp] for the sliced fields). The
    documents' cu_seqlens stay those of the whole rows (what the attention's mask is built from)."""
    if cp == 1:
        return mb
    index = local_positions(mb.tokens.shape[1], cp, rank)
    sliced = {name: getattr(mb, name).index_select(1, index) for name in _SLICED}
    return dataclasses.replace(mb, **sliced)
