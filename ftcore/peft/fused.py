"""A LoRA linear and its frozen base as one autograd function (CPU runtime, TP 1).

Built from autograd's pieces, one adapted linear is the base GEMM, A·x, one B GEMM per slice, the
adds that put the slices into the base output, and in backward an extra [tokens, in] add where the
base's and the adapter's input gradients meet: a dozen autograd nodes and as many small kernels
per linear, which on a CPU with a tiny model cost as much as the GEMMs. Here the forward adds each
B product into its slice of the base output in place (addmm into a strided view), and the backward
adds the adapter's input gradient into the base's (addmm again). Same products, summed in another
order, so results agree to rounding (tests/unit/peft/test_fused.py).

Slices that are one contiguous run of the fused output (gate/up, a row-parallel output) take one
addmm each. linear_qkv interleaves q, k and v per query group, so there the slices' B matrices are
laid into one [out, r * slices] matrix (zeros elsewhere) and one forward GEMM serves them all: a
few wasted multiplies by zero in an r-wide GEMM instead of a GEMM per group and slice. Backward
gathers each slice's gradient columns once instead (its two GEMMs would otherwise run through the
other slices' zeros too; the bench model's qkv forward and backward, one thread: 13.2 -> 12.7 ms).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Where each B writes: for slice i, A's rows a_cols[i] feed B i, whose output rows land at
    `rows[i]` of the fused output (one contiguous run `runs[i]` when `dense` is False)."""

    out: int
    a_sizes: tuple[int, ...]  # rows of each A, in the order they are concatenated
    a_cols: tuple[tuple[int, int], ...]  # per B: its A's rows in the concatenated A
    runs: tuple[tuple[int, int], ...]  # per B: (first, end) output row, when contiguous
    rows: tuple[torch.Tensor, ...]  # per B: output rows, when not
    dense: bool


def layout(out: int, a_sizes: dict[str, int], b_of: dict[str, str], rows: dict) -> Layout:
    """a_sizes: A key -> rank; b_of: slice -> its A key; rows: slice -> LongTensor of the fused
    output rows its B writes, in B's row order."""
    starts, c = {}, 0
    for key, r in a_sizes.items():
        starts[key], c = (c, c + r), c + r
    names = list(b_of)
    runs, contiguous = [], True
    for s in names:
        idx = rows[s]
        first, end = int(idx[0]), int(idx[-1]) + 1
        contiguous &= end - first == idx.numel() and bool((idx.diff() == 1).all())
        runs.append((first, end))
    return Layout(out, tuple(a_sizes.values()), tuple(starts[b_of[s]] for s in names),
                  tuple(runs), tuple(rows[s] for s in names), not contiguous)  # fmt: skip


class Hidden:
    """Adapter parameters handed to the function out of autograd's sight: their gradients go
    straight into megatron DDP's `main_grad` (see lora_linear), so autograd keeps no edge,
    AccumulateGrad node or DDP hook for them."""

    __slots__ = ("params",)

    def __init__(self, params: tuple):
        self.params = params


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, lay: Layout, scale: float, *params):
        hidden = len(params) == 1 and isinstance(params[0], Hidden)
        params = params[0].params if hidden else params
        n_a = len(lay.a_sizes)
        a = _as(torch.cat(params[:n_a]) if n_a > 1 else params[0], x.dtype)
        bs = [_as(b, x.dtype) for b in params[n_a:]]
        x2 = x.reshape(-1, x.shape[-1])
        y = x2 @ weight.t()
        h = x2 @ a.t()  # [tokens, r * A's], unscaled: the scale rides on the GEMMs' alpha
        if lay.dense:
            y.addmm_(h, _dense_b(lay, bs, h).t(), alpha=scale)
        else:
            for (c0, c1), (r0, r1), b in zip(lay.a_cols, lay.runs, bs):
                y[:, r0:r1].addmm_(h[:, c0:c1], b.t(), alpha=scale)
        ctx.save_for_backward(x2, weight, a, h, *bs)
        ctx.lay, ctx.scale, ctx.lead = lay, scale, x.shape[:-1]
        ctx.params, ctx.hidden = params, hidden
        return y.view(*x.shape[:-1], lay.out)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, a, h, *bs = ctx.saved_tensors
        lay, s = ctx.lay, ctx.scale
        g = grad.reshape(-1, lay.out)
        # products without the scale (it rides on the GEMMs' alpha): dh = dy/dh / s. Each slice's
        # output gradient is a view of g, or for interleaved rows one copy of its columns: the
        # dense B's GEMMs would multiply through all slices' zeros (3x the work for q, k, v)
        dh = h.new_zeros(h.shape)
        dbs = []
        for (c0, c1), (r0, r1), rows, b in zip(lay.a_cols, lay.runs, lay.rows, bs):
            gi = g.index_select(1, rows) if lay.dense else g[:, r0:r1]
            dh[:, c0:c1].addmm_(gi, b)
            dbs.append((gi.t(), h[:, c0:c1]))  # dB = s * this product
        dx = None
        if ctx.needs_input_grad[0]:
            dx = g @ weight
            dx.addmm_(dh, a, alpha=s)
            dx = dx.view(*ctx.lead, x2.shape[-1])
        starts = [0, *itertools.accumulate(lay.a_sizes)]
        das = [(dh[:, c0:c1].t(), x2) for c0, c1 in zip(starts, starts[1:])]  # dA = s * this
        if ctx.hidden:
            for p, (m1, m2) in zip(ctx.params, [*das, *dbs]):
                p.main_grad.addmm_(m1, m2, alpha=s)
            return dx, None, None, None, None
        grads = []
        for p, (m1, m2) in zip(ctx.params, [*das, *dbs]):
            d = torch.mm(m1, m2)
            grads.append(_as(d.mul_(s) if s != 1.0 else d, p.dtype))
        return dx, None, None, None, *grads


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _into_main(p: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether p's gradient can go straight into megatron DDP's main_grad: wrap_ddp marked it
    (overlap_grad_reduce off, where DDP's hook does nothing but that add) and main_grad has the
    dtype the gradient is computed in."""
    main = getattr(p, "main_grad", None)
    return getattr(p, "ftcore_grad_into_main", False) and main is not None and main.dtype == dtype


def _dense_b(lay: Layout, bs: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """The slices' B matrices in one [out, r * A's] matrix: B i at its output rows and its A's
    columns, zero elsewhere."""
    full = h.new_zeros(lay.out, h.shape[-1])
    for (c0, c1), rows, b in zip(lay.a_cols, lay.rows, bs):
        full[:, c0:c1].index_copy_(0, rows, b)
    return full


def lora_linear(x, weight, lay: Layout, scale: float, a_params, b_params) -> torch.Tensor:
    """x @ weight.T + the adapters' outputs in their slices; weight is frozen.

    The adapters go to autograd as inputs, unless their gradients can go straight into DDP's
    main_grad (megatron's gradient_accumulation_fusion does the same for TE's wgrad GEMMs): then
    they are hidden, which saves an AccumulateGrad node, a DDP hook and a gradient tensor per
    adapter and micro-batch. Hiding needs x to carry the graph (the first layer's input does not,
    with a frozen embedding and norm), or the backward would never run."""
    params = (*a_params, *b_params)
    if x.requires_grad and torch.is_grad_enabled() and all(_into_main(p, x.dtype) for p in params):
        return _LoraLinear.apply(x, weight, lay, scale, Hidden(params))
    return _LoraLinear.apply(x, weight, lay, scale, *params)
