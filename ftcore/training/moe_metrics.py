"""A mixture-of-experts step's auxiliary-loss scale and its metrics.jsonl fields: `aux_loss` (the
optimised auxiliary total: coefficient x load-balancing loss, plus the z-loss, summed over layers,
token-weighted over the step's micro-batches) and `expert_load_max_over_mean` (the worst layer's
most loaded expert over the mean; 1.0 is perfect balance). docs/moe.md. A model with an expert
bias (DeepSeek-V3, GLM-4.5) also logs `expert_bias_shift`: the largest distance of any expert's
bias from the one loaded (the published bias), which moe.expert_bias_update_rate moves
(docs/deepseek.md); 0 while the rate is 0."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ftcore.models import moe_routing
from ftcore.models.sharding import unwrap
from ftcore.runtime import collectives
from ftcore.runtime import dist as rdist


def is_moe(model: list) -> bool:
    return getattr(unwrap(model[0]).config, "num_moe_experts", None) is not None


def _world_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.all_reduce(t)
    return t


@contextmanager
def scaled_step(state, microbatches: list, contribute: bool):
    """Around one training step's forward and backward: the global batch's target tokens / valid
    tokens for the routers (models/moe_routing.py), summed over the world from the ranks that
    load distinct micro-batches (`contribute`, step.is_data_rank). The counts are summed on the
    host from the host micro-batches and written into a device tensor as numbers (no
    host-to-device copy for the host to wait on, no device read before the forward);
    `state.extra["moe_tokens"]` keeps them for `collect`."""
    t = torch.zeros(2, device=rdist.comm_device())
    if contribute:
        t[0] = float(sum(mb.num_tokens for mb in microbatches))
        t[1] = float(sum(mb.num_target_tokens for mb in microbatches))
    t = _world_sum(t)
    state.extra["moe_tokens"] = t
    with moe_routing.step_scale(t[1] / t[0].clamp_min(1.0)):
        yield


def collect(state) -> dict:
    """The step's `aux_loss` and `expert_load_max_over_mean`, summed over the world (each layer's
    router lives on one pipeline stage; TP/SP, CP, DP and EP ranks hold disjoint tokens), and the
    routers' counters set back to zero. One all-reduce and one host read per step."""
    rs = moe_routing.routers(state.model)
    config = unwrap(state.model[0]).config
    width = 2 + config.num_moe_experts + 1  # the last column: the expert bias's shift
    table = torch.zeros(config.num_layers, width, device=rdist.comm_device())
    for r in rs:
        if r.ftcore_stats is not None:
            table[r.layer_number - 1, :-1] += r.ftcore_stats.to(table.device)
            r.ftcore_stats.zero_()
        table[r.layer_number - 1, -1] = moe_routing.bias_shift(r).to(table.device)
    table = _world_sum(table).double().cpu()
    bias = config.moe_router_enable_expert_bias
    valid = float(state.extra["moe_tokens"][0]) if "moe_tokens" in state.extra else 0.0
    out = {"aux_loss": float(table[:, moe_routing.LB : moe_routing.Z + 1].sum()) / max(valid, 1.0)}
    if config.moe_z_loss_coeff is not None:
        out["z_loss"] = float(table[:, moe_routing.Z].sum()) / max(valid, 1.0)
    if bias:  # every rank of a stage holds the same router: the sum counts it world / pp times
        world = dist.get_world_size() if dist.is_initialized() else 1
        out["expert_bias_shift"] = (
            float(table[:, -1].max()) * config.pipeline_model_parallel_size / world
        )
    load = table[:, moe_routing.LOAD : -1]
    routed = load.sum(dim=1) > 0  # dense layers (model.moe_dense_layers) route nothing
    if routed.any():
        per_layer = load[routed].max(dim=1).values / load[routed].mean(dim=1)
        out["expert_load_max_over_mean"] = float(per_layer.max())
    return out
