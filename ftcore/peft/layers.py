"""LoRA on megatron's column- and row-parallel linears, in the base layer's parallel state.

The adapter output is added to the base output, so it must be sharded exactly like it:
- column-parallel base (linear_qkv, linear_fc1): output [s, b, out/tp]. A (r x in) is replicated,
  each B (out_slice/tp x r) is sharded like its slice of the base output. The [s, b, r] product
  A·x enters the TP region like the base input does: copied (backward: all-reduce) without
  sequence parallel, all-gathered along the sequence (backward: reduce-scatter) with it. With SP
  each rank sees only its sequence chunk, so A's gradient is partial: A is marked
  `sequence_parallel` and megatron's finalize_model_grads all-reduces it across TP.
- row-parallel base (linear_proj, linear_fc2): input [s, b, in/tp], output [s(/tp), b, h]. A
  (r x in/tp) is sharded like the base input, B (h x r) is replicated. The partial A·x is summed
  like the base output: all-reduced, or reduce-scattered along the sequence with SP (then B's
  gradient is partial and B is marked `sequence_parallel`).

A fused column layer has slices (q, k, v or gate, up). Each slice has its own B; A is either one
per slice (Hugging Face target names) or shared by all slices (megatron names). The slice deltas
are put back in megatron's fused layout: per query group [q heads, k, v] for linear_qkv, [gate; up]
per TP shard for linear_fc1. The functions below are plain so TE variants can reuse them.
MLA's column-parallel up projections have one slice each; its down projections (REPLICATED,
models/mla.py) are whole on every TP rank: A and B replicated, no communication, and under SP
both gradients partial (each rank's tokens), so both are marked `sequence_parallel`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import (
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from torch import nn

from ftcore.peft import fused
from ftcore.peft.config import COLUMN, REPLICATED, SLICES, Geometry
from ftcore.runtime import cpu


def fuse_column(
    module: str, deltas: dict[str, torch.Tensor], geo: Geometry, tp: int
) -> torch.Tensor:
    """Put per-slice outputs [s, b, slice/tp] into the fused layout of the base output; missing
    slices are zero."""
    ref = next(iter(deltas.values()))
    lead = ref.shape[:-1]
    if len(SLICES[module]) == 1:  # MLA's up projections: one slice, the whole output
        return ref

    def part(name: str, width: int) -> torch.Tensor:
        t = deltas.get(name)
        return t if t is not None else ref.new_zeros(*lead, width)

    if module == "linear_fc1":
        f = geo.ffn // tp
        return torch.cat([part("gate_proj", f), part("up_proj", f)], dim=-1)
    g, d = geo.groups // tp, geo.head_dim
    qpg = geo.heads // geo.groups * d
    q = part("q_proj", g * qpg).reshape(*lead, g, qpg)
    k = part("k_proj", g * d).reshape(*lead, g, d)
    v = part("v_proj", g * d).reshape(*lead, g, d)
    return torch.cat([q, k, v], dim=-1).reshape(*lead, g * (qpg + 2 * d))


def _column_views(module: str, out: torch.Tensor, geo: Geometry, tp: int) -> dict:
    """Each slice's view of a fused column output [..., out/tp] (q, k, v interleaved per query
    group for linear_qkv; gate then up for linear_fc1), shaped [..., slice/tp] or [..., g, w]."""
    if len(SLICES[module]) == 1:
        return {SLICES[module][0]: out}
    if module == "linear_fc1":
        f = geo.ffn // tp
        return {"gate_proj": out[..., :f], "up_proj": out[..., f:]}
    g, d = geo.groups // tp, geo.head_dim
    qpg = geo.heads // geo.groups * d
    o = out.view(*out.shape[:-1], g, qpg + 2 * d)
    return {"q_proj": o[..., :qpg], "k_proj": o[..., qpg : qpg + d], "v_proj": o[..., qpg + d :]}


class _AddIntoSlices(torch.autograd.Function):
    """out[slice] += delta for each slice, in place: the fused layout without concatenating the
    deltas into a new [s, b, out] tensor. Backward hands each delta its view of the gradient."""

    @staticmethod
    def forward(ctx, out, module, geo, tp, names, *deltas):
        views = _column_views(module, out, geo, tp)
        for name, delta in zip(names, deltas):
            views[name].add_(delta.view(views[name].shape))
        ctx.mark_dirty(out)
        ctx.layout = (module, geo, tp, names, [d.shape for d in deltas])
        return out

    @staticmethod
    def backward(ctx, grad):
        module, geo, tp, names, shapes = ctx.layout
        views = _column_views(module, grad, geo, tp)
        return (grad, None, None, None, None,
                *(views[n].reshape(shape) for n, shape in zip(names, shapes)))  # fmt: skip


def add_column(out: torch.Tensor, module: str, deltas: dict, geo: Geometry, tp: int):
    """`out + fuse_column(deltas)`, computed in place in `out` (the base's fresh output)."""
    names = tuple(deltas)
    return _AddIntoSlices.apply(out, module, geo, tp, names, *(deltas[n] for n in names))


def _tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def _dropout(x: torch.Tensor, p: float, training: bool, per_rank: bool) -> torch.Tensor:
    """Dropout on the adapter input. A TP-sharded or sequence-parallel input needs a different mask
    per TP rank (megatron's tracker RNG); a replicated one the same mask on every rank."""
    if p == 0.0 or not training:
        return x
    if per_rank:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


def column_lora(
    x,
    lora_a: dict,
    lora_b: dict,
    a_of: dict,
    *,
    scale: float,
    sp: bool,
    dropout: float = 0.0,
    training: bool = False,
) -> dict[str, torch.Tensor]:
    """Adapter outputs of a column-parallel base, per slice: {slice: [s, b, slice_out/tp]}.

    x: the base layer's input ([s/tp, b, h] with SP, else [s, b, h], replicated across TP)."""
    x = _dropout(x, dropout, training, per_rank=sp)
    keys = list(lora_a)
    a = torch.cat([lora_a[k] for k in keys]) if len(keys) > 1 else lora_a[keys[0]]
    # the scale goes on the (concatenated) A, not on each [s, b, out] output: same product, one
    # pass over a small matrix
    h = F.linear(x, (a * scale).to(x.dtype))  # [s(/tp), b, r * n_A]
    if sp:
        h = tensor_parallel.gather_from_sequence_parallel_region(
            h, tensor_parallel_output_grad=True
        )
    elif _tp_size() > 1:  # megatron's copy is the identity (and a Python autograd node) at TP 1
        h = tensor_parallel.copy_to_tensor_model_parallel_region(h)
    parts = dict(zip(keys, h.split([lora_a[k].shape[0] for k in keys], dim=-1)))
    return {s: F.linear(parts[a_of[s]], b.to(h.dtype)) for s, b in lora_b.items()}


def row_lora(
    x,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    *,
    scale: float,
    sp: bool,
    dropout: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """Adapter output of a row-parallel base, in its output state ([s/tp, b, h] with SP, else
    [s, b, h]). x: the base input [s, b, in/tp]."""
    x = _dropout(x, dropout, training, per_rank=True)
    h = F.linear(x, (lora_a * scale).to(x.dtype))  # partial sums over this rank's input features
    if sp:
        h = tensor_parallel.reduce_scatter_to_sequence_parallel_region(h)
    elif _tp_size() > 1:
        h = tensor_parallel.reduce_from_tensor_model_parallel_region(h)
    return F.linear(h, lora_b.to(h.dtype))


def _mark(p: nn.Parameter, *, sharded_dim: int | None, sp: bool) -> nn.Parameter:
    if sharded_dim is None:
        p.tensor_model_parallel = False
        p.partition_dim = -1
        p.partition_stride = 1
    else:
        set_tensor_model_parallel_attributes(p, True, sharded_dim, 1)
    if sp and sharded_dim is None:
        p.sequence_parallel = True  # its gradient sees only this rank's sequence chunk
    return p


def device_of(base: nn.Module) -> torch.device:
    """Where the adapted layer's weights live. Adapters are created there: without the distributed
    optimizer's buffer nothing moves them later, and a dry build keeps them on `meta`."""
    for t in (*base.parameters(), *base.buffers()):
        return t.device
    return torch.device("cpu")


class LoraParallelLinear(nn.Module):
    """A frozen megatron linear (`base_layer`) plus LoRA adapters on some of its slices.

    Parameters: `lora_A.<key>` (key: a slice's HF name, or the megatron name for a shared A) and
    `lora_B.<slice>`. Forward returns the base's (output, bias) with the adapter output added;
    with `adapters_on` false the base's alone (DPO's reference: peft/reference.py)."""

    adapters_on = True

    def __init__(
        self,
        base: nn.Module,
        module: str,
        slices: dict[str, str],
        *,
        geo: Geometry,
        r: int,
        scale: float,
        dropout: float,
        tp: int,
        sp: bool,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.base_layer = base
        self.module, self.geo, self.tp, self.sp = module, geo, tp, sp
        self.scale, self.dropout, self.r = scale, dropout, r
        self.a_of = dict(slices)  # slice -> A key
        self.column = module in COLUMN
        self.replicated = module in REPLICATED
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self._fused_layout = None
        like = dict(device=device_of(base), dtype=dtype)  # the base's device, the model's dtype
        whole_in = self.column or self.replicated
        for s, key in slices.items():
            out, inp = geo.out_in(s)
            if key not in self.lora_A:
                self.lora_A[key] = _mark(nn.Parameter(torch.zeros(r, inp if whole_in else inp // tp, **like)),
                                         sharded_dim=None if whole_in else 1, sp=sp and whole_in)  # fmt: skip
            b_out = out // tp if self.column else out
            self.lora_B[s] = _mark(nn.Parameter(torch.zeros(b_out, r, **like)),
                                   sharded_dim=0 if self.column else None, sp=sp and not self.column)  # fmt: skip

    def column_deltas(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return column_lora(x, dict(self.lora_A), dict(self.lora_B), self.a_of, scale=self.scale,
                           sp=self.sp, dropout=self.dropout, training=self.training)  # fmt: skip

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter output in the base output's layout (zeros for slices without one)."""
        if self.column:
            return fuse_column(self.module, self.column_deltas(x), self.geo, self.tp)
        (key,), (s,) = list(self.lora_A), list(self.lora_B)
        if self.replicated:  # whole on every rank: no communication (module docstring)
            x = _dropout(x, self.dropout, self.training, per_rank=self.sp)
            a = (self.lora_A[key] * self.scale).to(x.dtype)
            return F.linear(F.linear(x, a), self.lora_B[s].to(x.dtype))
        return row_lora(x, self.lora_A[key], self.lora_B[s], scale=self.scale, sp=self.sp,
                        dropout=self.dropout, training=self.training)  # fmt: skip

    def _plain_base(self, args, kwargs) -> bool:
        """On the CPU runtime at TP 1 (no SP, no bias, no extra arguments) megatron's linear adds
        only identity TP regions and Python autograd functions to one GEMM."""
        base = self.base_layer
        return (
            self.tp == 1
            and not self.sp
            and not args
            and not kwargs
            and type(base)
            in (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)
            and base.bias is None
            and not base.weight.requires_grad
            and cpu.is_active()
        )

    def _base(self, x, *args, **kwargs):
        """The frozen base's (output, bias): one F.linear where `_plain_base`."""
        if self._plain_base(args, kwargs):
            return F.linear(x, self.base_layer.weight), None
        return self.base_layer(x, *args, **kwargs)

    def _layout(self) -> fused.Layout:
        """Where each B writes in the base output (built once; see peft/fused.py)."""
        if self._fused_layout is None:
            w = self.base_layer.weight
            out = w.shape[0]
            idx = torch.arange(out, device=w.device)
            if self.column:
                views = _column_views(self.module, idx, self.geo, self.tp)
                rows = {s: views[s].reshape(-1) for s in self.lora_B}
            else:
                rows = {s: idx for s in self.lora_B}
            a_sizes = {k: a.shape[0] for k, a in self.lora_A.items()}
            self._fused_layout = fused.layout(
                out, a_sizes, {s: self.a_of[s] for s in self.lora_B}, rows
            )
        return self._fused_layout

    def forward(self, x, *args, **kwargs):
        if not self.adapters_on:
            return self._base(x, *args, **kwargs)
        if self._plain_base(args, kwargs) and (self.dropout == 0.0 or not self.training):
            w = self.base_layer.weight
            return fused.lora_linear(x, w, self._layout(), self.scale, self.lora_A.values(),
                                     self.lora_B.values()), None  # fmt: skip
        out, bias = self._base(x, *args, **kwargs)
        if self.column:  # added into the base's slices: no fused copy, no zeros for the rest
            deltas = {k: d.to(out.dtype) for k, d in self.column_deltas(x).items()}
            return add_column(out, self.module, deltas, self.geo, self.tp), bias
        return out + self.lora_delta(x).to(out.dtype), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Base under `base_layer.`; each sharded adapter tensor with its TP axis, so every TP
        rank's shard is saved (and replicated ones once)."""
        return adapter_sharded_state_dict(self, prefix, sharded_offsets, metadata)


def adapter_sharded_state_dict(layer, prefix: str, sharded_offsets: tuple, metadata, **groups):
    """A LoRA layer's checkpoint entries: its base under `base_layer.`, each adapter tensor with
    its TP axis; `groups` (tp_group, dp_cp_group) where they are not the dense layer's."""
    sd = sharded_state_dict_default(
        layer.base_layer, f"{prefix}base_layer.", sharded_offsets, metadata
    )
    tensors, axes = {}, {}
    for kind, params in (("lora_A", layer.lora_A), ("lora_B", layer.lora_B)):
        for k, p in params.items():
            tensors[f"{kind}.{k}"] = p
            if getattr(p, "tensor_model_parallel", False):
                axes[f"{kind}.{k}"] = p.partition_dim
    sd.update(make_sharded_tensors_for_checkpoint(tensors, prefix, axes, sharded_offsets, **groups))
    return sd
