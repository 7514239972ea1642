"""The planner: memory per pipeline stage, throughput, and whether a job fits, from its config.

`plan(cfg, world)` returns the JSON of docs/design.md (`python -m ftcore.plan`); `check_fit(cfg, world)`
is validate()'s memory-fit step (ftcore.train refuses a job predicted not to fit).
"""

from __future__ import annotations

import copy

from omegaconf import DictConfig

from ftcore.errors import FtcoreError
from ftcore.planner import grpo, memory
from ftcore.planner import throughput as _throughput
from ftcore.planner.activations import routed_factor
from ftcore.planner.cp import comm_type as cp_comm_type
from ftcore.planner.labels import labels
from ftcore.planner.memory import GiB, StageMemory, all_stages, host_bytes
from ftcore.planner.params import active_params, is_moe, moe_layer_count, mtp_params, total_params
from ftcore.planner.search import smallest_fit
from ftcore.planner.view import view

__all__ = ["check_fit", "plan", "gpus_needed"]


def world_of(cfg: DictConfig, world: int | None = None) -> int:
    if world:
        return int(world)
    if cfg.cluster.num_gpus:
        return int(cfg.cluster.num_gpus)
    p = cfg.parallel
    return p.tp * p.pp * p.cp


def capacity(cfg: DictConfig) -> int:
    return int(cfg.cluster.gpu_mem_gib * GiB)


def worst_stage(stages: list[StageMemory]) -> StageMemory:
    return max(stages, key=lambda s: s.total)


def check_fit(cfg: DictConfig, world_size: int) -> None:
    """Raise FtcoreError naming the stage, the total and the largest term unless it fits
    (or `plan.enforce=false`)."""
    if not cfg.plan.enforce:
        return
    cfg = view(cfg)
    stages = all_stages(cfg, world_of(cfg, world_size))
    worst = worst_stage(stages)
    cap = capacity(cfg)
    if memory.fits(cfg, worst, cap):
        return
    name, size = worst.largest()
    keep = memory.margin(cfg, worst)
    raise FtcoreError(
        f"predicted out of memory: pipeline stage {worst.pp_rank} needs {worst.total / GiB:.1f} GiB "
        f"+ {keep / GiB:.1f} GiB headroom (plan.headroom={cfg.plan.headroom} of the estimated "
        f"activations) per GPU of {cap / GiB:.1f} GiB on {cfg.cluster.name} (largest term: {name} "
        f"{size / GiB:.1f} GiB; `python -m ftcore.plan` shows every term)",
        field="cluster.gpu_mem_gib",
        fix="add GPUs or change the layout (parallel.tp/pp, distributed_optimizer, recompute, "
        "train.micro_batch_size; `plan.search=true` ranks layouts that fit), "
        "or set plan.enforce=false",
    )


def _stage_json(s: StageMemory) -> dict:
    return {
        "pp_rank": s.pp_rank,
        "layers": s.layers,
        "memory_gib": {
            "weights": s.weights / GiB,
            "grads": s.grads / GiB,
            "optimizer": s.optimizer / GiB,
            "activations": s.activations / GiB,
            "reserve": s.reserve / GiB,
            "load_peak": s.load / GiB,
            "total": s.total / GiB,
        },
        "parts": {
            k: (v / GiB if isinstance(v, int) and k not in _COUNTS else v)
            for k, v in s.parts.items()
        },
    }


_COUNTS = ("layers_in_flight", "elements")


def _host_gib(cfg, world: int) -> dict:
    """Host memory per rank (memory.host_bytes), the most any pipeline stage needs, per phase."""
    per_stage = [host_bytes(cfg, world, r) for r in range(cfg.parallel.pp)]
    return {k: max(h[k] for h in per_stage) / GiB for k in per_stage[0]}


def _params(cfg, world: int) -> dict:
    """Total and active parameters; for a MoE model the experts and where they live."""
    out = {"total": total_params(cfg), "active": active_params(cfg)}
    base = copy.deepcopy(cfg)
    base.peft.name = "none"
    out["base"] = total_params(base)  # the model without adapters: what its card counts
    if mtp_params(base):  # DeepSeek-V3/GLM-4.5: carried into the export, not built
        out["mtp"] = mtp_params(base)
    m, p = cfg.model, cfg.parallel
    if is_moe(m):
        ep = getattr(p, "ep", 1)
        dpc = world // (p.tp * p.pp * p.cp) * p.cp
        out["moe"] = {
            "experts": m.num_experts,
            "topk": m.moe_router_topk,
            "moe_layers": moe_layer_count(m),
            "experts_per_ep_rank": m.num_experts // ep,
            "expert_dp": memory.expert_dp(cfg, dpc),
            "routed_factor": routed_factor(cfg),
        }
    return out


def gpus_needed(cfg: DictConfig) -> int | None:
    """Fewest GPUs of this cluster type on which some layout fits (search over tp/pp/cp/dp)."""
    return smallest_fit(cfg)


def plan(cfg: DictConfig, world_size: int | None = None) -> dict:
    """The plan of docs/design.md: memory per stage (worst stage on top), fit, GPUs needed, speed."""
    cfg = view(cfg)
    world = world_of(cfg, world_size)
    stages = all_stages(cfg, world)
    worst = worst_stage(stages)
    cap = capacity(cfg)
    speed = _throughput.throughput(cfg, world)
    p = cfg.parallel
    st = speed["time"]
    out = {
        "exp": cfg.run.exp,
        "model": cfg.model.name,
        "peft": cfg.peft.name,
        "precision": cfg.precision.name,
        "cluster": cfg.cluster.name,
        "num_gpus": world,
        "layout": {
            "tp": p.tp,
            "pp": p.pp,
            "vp": p.vp,
            "cp": p.cp,
            "cp_comm_type": cp_comm_type(p),
            "dp": world // (p.tp * p.pp * p.cp),
            "ep": getattr(p, "ep", 1),
            "etp": getattr(p, "etp", 1),
            "sp": bool(p.sp),
            "distributed_optimizer": bool(p.distributed_optimizer),
            "recompute": p.recompute,
            "micro_batch_size": cfg.train.micro_batch_size,
            "global_batch_size": cfg.train.global_batch_size,
            "seq_len": cfg.data.seq_len,
        },
        "params": _params(cfg, world),
        "gpu_mem_gib": cap / GiB,
        "memory_gib": {
            "weights": worst.weights / GiB,
            "grads": worst.grads / GiB,
            "optimizer": worst.optimizer / GiB,
            "activations": worst.activations / GiB,
            "reserve": worst.reserve / GiB,
            "load_peak": worst.load / GiB,
            "total": worst.total / GiB,
        },
        "worst_stage": worst.pp_rank,
        "host_gib": _host_gib(cfg, world),
        "stages": [_stage_json(s) for s in stages],
        "fits": memory.fits(cfg, worst, cap),
        "headroom_gib": memory.margin(cfg, worst) / GiB,
        "spare_gib": (cap - worst.total) / GiB,
        "gpus_needed": gpus_needed(cfg),
        "tokens_per_s_per_gpu": speed["tokens_per_s_per_gpu"],
        "model_tflops_per_gpu": speed["model_tflops_per_gpu"],
        "mfu": speed["mfu"],
        "mfu_basis": speed["mfu_basis"],
        "labels": labels(cfg),
        "step_time_s": speed["step_time_s"],
        "step_time_parts_s": {
            "compute": st.compute_s,
            "tp_cp_comm": st.tp_comm_s,
            "pipeline_bubble": st.bubble_s,
            "pipeline_send": st.pp_comm_s,
            "dp_comm": st.dp_comm_s,
            "optimizer": st.optimizer_s,
            "overhead": st.overhead_s,
            "ep_a2a": st.ep_comm_s,
            "host_bound": st.host_bound_s,
        },
    }
    if grpo.active(cfg):  # rollout, forward-only passes and update priced apart (planner/grpo.py)
        out["grpo"] = _grpo(cfg, world, stages, speed)
    return out


def _grpo(cfg, world: int, stages: list[StageMemory], speed: dict) -> dict:
    weights = [
        s.parts["frozen_weights"] + s.parts["trainable_weights"] + s.parts["quantized_weights"]
        for s in stages
    ]
    st = speed["time"]
    return grpo.price(cfg, world, weights, st.total, st.compute_s)
