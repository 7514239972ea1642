"""Row gathers whose backward is a gather too (the CPU attention's document layout).

`x.index_select(0, index)` differentiates into `index_add_` on a zeroed tensor, which on CPU is a
serial scatter: 6-9x slower than the gather itself at the attention's [tokens * heads, d] sizes,
and the packed step ran about 17 of them. Where every source row's gradient comes from exactly one
gathered slot (the others, such as a padded document's repeats of its first token, provably get a
zero gradient), the backward is the gather of the gradient at those slots instead, with the rows
no slot takes set to zero. Same values: the scatter would only have added zeros to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowGather:
    index: torch.Tensor  # source row of each gathered slot
    inverse: torch.Tensor  # per source row: the slot its gradient comes from (any, if missing)
    missing: torch.Tensor  # source rows no slot takes: zero gradient


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: RowGather):
        ctx.plan = plan
        return x.index_select(0, plan.index)

    @staticmethod
    def backward(ctx, grad):
        if not grad.shape[0]:  # nothing was gathered
            return grad.new_zeros(ctx.plan.inverse.shape[0], *grad.shape[1:]), None
        dx = grad.index_select(0, ctx.plan.inverse)
        if ctx.plan.missing.numel():
            dx.index_fill_(0, ctx.plan.missing, 0)
        return dx, None


def gather(x: torch.Tensor, plan: RowGather) -> torch.Tensor:
    """x.index_select(0, plan.index), differentiated by `plan.inverse`."""
    return _Gather.apply(x, plan)
