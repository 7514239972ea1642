"""Attention under context parallelism for the local (non-Transformer-Engine) layer spec.

The all-gather form (Llama 3's): every CP rank all-gathers the keys and values of the whole
sequence from its CP group, attends its own query chunks (data/cp.py: chunks r and 2*cp-1-r) to
them, and in backward the key/value gradients go back to the ranks that own those positions (each
rank's gradient of the gathered K/V summed over the group, then its own slice kept: a
reduce-scatter; gloo has none, so all-reduce + slice). Causal and document masks come from the
GLOBAL positions: step.py builds the [b, 1, s, s] mask of the whole rows and `local_mask` keeps this
rank's query rows and orders the key columns as the all-gather lays them out. Works on any backend
(gloo here, NCCL on a GPU without TE); with TE, TE's own CP attention runs instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftcore.runtime import collectives


class _GatherSequence(torch.autograd.Function):
    """[s_local, ...] -> [cp * s_local, ...] over `group` (rank order); backward sums the
    gradient over the group and returns this rank's rows."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        collectives.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        collectives.all_reduce(grad, group=ctx.group)
        n = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * n : (rank + 1) * n], None


def gather_sequence(t: torch.Tensor, group) -> torch.Tensor:
    return _GatherSequence.apply(t, group)


def local_mask(mask: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] mask of the whole rows -> [b, 1, s / cp, s]: this rank's query rows `rows`
    ([b, s / cp], data/cp.py row_positions), key columns in the order of the all-gathered keys
    `cols` ([b, s], gathered_row_positions) (True = masked out)."""
    b, _, s, _ = mask.shape
    rows, cols = rows.to(mask.device), cols.to(mask.device)
    picked = mask.gather(2, rows[:, None, :, None].expand(b, 1, rows.shape[1], s))
    return picked.gather(3, cols[:, None, None, :].expand(b, 1, rows.shape[1], s))


def attention(query, key, value, mask, scale: float, group) -> torch.Tensor:
    """query [s_local, b, heads, d], key/value [s_local, b, groups, d], mask from `local_mask`
    -> context [s_local, b, heads * d]. K and V travel in one all-gather."""
    s, b, heads, d = query.shape
    groups = key.shape[2]
    kv = gather_sequence(torch.cat([key, value], dim=-1), group)  # [s, b, groups, 2d]
    k, v = kv.split(d, dim=-1)
    q, k, v = query.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
    ctx = F.scaled_dot_product_attention(
        q, k, v, attn_mask=~mask, scale=scale, enable_gqa=groups != heads
    )
    return ctx.permute(2, 0, 1, 3).reshape(s, b, heads * d)
