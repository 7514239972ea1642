"""LoRA on megatron's mixture-of-experts layers: every local expert's linear_fc1/linear_fc2 (its own
A and B per expert) and, when targeted, the router.

megatron's experts (SequentialMLP on CPU) run in their own parallel state: tokens arrive through
the dispatcher already all-to-all'ed over EP and gathered over expert TP (etp), and leave as
partial sums the dispatcher reduces. So an expert linear communicates nothing itself, and neither
does its adapter: column (fc1) A [r, h] replicated over etp, each B [ffn/etp, r] sharded like the
base output; row (fc2) A [r, ffn/etp] sharded like the base input, B [h, r] replicated. With
etp > 1 the replicated factor sees only this rank's part of the product, so its gradient is
summed over the expert TP group (megatron's copy region on the weight: identity forward,
all-reduce backward). Each adapter parameter carries the base weight's `allreduce` flag, so
megatron's DDP reduces its gradient over the expert data-parallel group, as the base experts'
would. On a GPU with Transformer Engine, targeting the experts builds them as SequentialMLP of TE
linears (models/moe.py), which these wrap the same way; TE's grouped experts (TEGroupedMLP) would
hold every expert's weight in one module.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from torch import nn

from ftcore.peft.config import Geometry
from ftcore.peft.layers import LoraParallelLinear, adapter_sharded_state_dict, add_column, device_of


def is_moe_layer(mlp: nn.Module) -> bool:
    return hasattr(mlp, "router") and hasattr(mlp, "experts")


def adapter_params(chunks):
    """(global name, parameter) of this rank's adapters; experts under their global index
    (models/sharding.py names them so)."""
    from ftcore.models.sharding import iter_params

    for name, p in iter_params(chunks):
        if ".lora_" in name:
            yield name, p


def shard_group_of(p) -> tuple[int, int]:
    """(size, rank) of the group a parameter is sharded over: TP, or an expert's etp."""
    if hasattr(p, "shard_tp"):
        return p.shard_tp, p.shard_group.rank() if p.shard_tp > 1 else 0
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def _sum_grad(w: torch.Tensor, group, size: int) -> torch.Tensor:
    if size == 1:
        return w
    return tensor_parallel.copy_to_tensor_model_parallel_region(w, group=group)


class ExpertLoraLinear(LoraParallelLinear):
    """One expert's linear_fc1 or linear_fc2 with its adapters; `shard_tp`/`shard_group` on each
    parameter say over which group (etp) its sharded dimension is split."""

    def __init__(self, base, module, slices, *, geo: Geometry, r, scale, dropout, dtype):
        etp = base.tp_group.size() if getattr(base, "tp_group", None) is not None else 1
        super().__init__(base, module, slices, geo=geo, r=r, scale=scale, dropout=dropout,
                         tp=etp, sp=False, dtype=dtype)  # fmt: skip
        self.etp_group = base.tp_group
        allreduce = getattr(base.weight, "allreduce", True)
        for p in (*self.lora_A.values(), *self.lora_B.values()):
            p.allreduce = allreduce  # False under ep: DDP reduces it over the expert DP group
            p.shard_tp, p.shard_group = etp, self.etp_group

    def forward(self, x, *args, **kwargs):
        out, bias = self.base_layer(x, *args, **kwargs)
        if not self.adapters_on:  # DPO's reference (peft/reference.py)
            return out, bias
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout, True)
        if self.column:
            deltas = {}
            for s, b in self.lora_B.items():
                a = _sum_grad(self.lora_A[self.a_of[s]], self.etp_group, self.tp)
                deltas[s] = F.linear(F.linear(x, (a * self.scale).to(x.dtype)), b.to(x.dtype))
            return add_column(out, self.module, deltas, self.geo, self.tp), bias
        (a,), (b,) = self.lora_A.values(), self.lora_B.values()
        b = _sum_grad(b, self.etp_group, self.tp)
        return out + F.linear(F.linear(x, (a * self.scale).to(x.dtype)), b.to(x.dtype)), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """As the dense layer's, over the expert TP group (SequentialMLP sets the expert axis and
        the replica over the expert data-parallel group)."""
        return adapter_sharded_state_dict(
            self, prefix, sharded_offsets, metadata, tp_group=self.etp_group,
            dp_cp_group=parallel_state.get_expert_data_parallel_group())  # fmt: skip


def wrap_experts(mlp, plan: dict, *, geo: Geometry, r: int, scale: float, dropout: float, dtype):
    """Put adapters on every local expert's targeted linears (plan: {linear: {slice: A key}})."""
    egeo = geo.expert()
    for expert in mlp.experts.local_experts:
        for module in ("linear_fc1", "linear_fc2"):
            if module in plan:
                base = getattr(expert, module)
                setattr(expert, module, ExpertLoraLinear(
                    base, module, plan[module], geo=egeo, r=r, scale=scale, dropout=dropout,
                    dtype=dtype))  # fmt: skip


def _router_gating(self, input: torch.Tensor):
    logits = self._ftcore_gating(input)
    if not self.adapters_on:  # DPO's reference (peft/reference.py)
        return logits
    a, b = self.lora_A["gate"], self.lora_B["gate"]
    x = input.to(logits.dtype)
    return logits + F.linear(F.linear(x, (a * self.lora_scale).to(x.dtype)), b.to(x.dtype))


def adapt_router(router, *, geo: Geometry, r: int, scale: float, dtype, sp: bool) -> None:
    """A [r, h] and B [experts, r] on megatron's TopKRouter, added to its logits (in the router's
    dtype). Replicated like the router weight; with SP its input is this rank's sequence chunk,
    so the adapter's gradients are summed over TP (`sequence_parallel`) as the router's are."""
    like = dict(device=device_of(router), dtype=dtype)
    router.lora_A = nn.ParameterDict({"gate": nn.Parameter(torch.zeros(r, geo.hidden, **like))})
    router.lora_B = nn.ParameterDict({"gate": nn.Parameter(torch.zeros(geo.experts, r, **like))})
    for p in (router.lora_A["gate"], router.lora_B["gate"]):
        p.sequence_parallel = sp
    router.lora_scale = scale
    router.adapters_on = True  # the switch peft/reference.py turns off, as on a LoRA linear
    router._ftcore_gating = router.gating
    router.gating = types.MethodType(_router_gating, router)
