"""megatron's optimizer over the trainable parameters, and the LR schedule."""

from __future__ import annotations

import contextlib
import logging

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from omegaconf import DictConfig

from ftcore.errors import FtcoreError
from ftcore.runtime import cpu, foreach_grads

log = logging.getLogger("ftcore")


def build_optimizer(cfg: DictConfig, model: list, *, gloo_groups: bool = True):
    """Adam/AdamW (decoupled weight decay), clipping at train.grad_clip, fp32 main params.
    `gloo_groups=False`: without megatron's gloo side groups (the dry build has none)."""
    o = cfg.optim
    if o.name not in ("adam", "adamw"):
        raise FtcoreError(f"unknown optimizer {o.name!r}", field="optim.name", fix="adam or adamw")
    bf16 = cfg.precision.params_dtype == "bf16"
    config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=cfg.sched.min_lr,
        weight_decay=o.weight_decay,
        decoupled_weight_decay=o.name == "adamw",
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_eps=o.eps,
        clip_grad=cfg.train.grad_clip,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
    )
    if cpu.is_active():
        cpu.no_dynamo_wrappers()  # before torch's Optimizer is first built
    foreach_grads.install()  # megatron without TE/Apex: no host read per gradient
    with cpu.device_mode():
        optimizer = get_megatron_optimizer(config, model, use_gloo_process_groups=gloo_groups)
    expert_norm_over_expert_tp(optimizer)
    if cpu.is_active():
        cpu.fused_adam(optimizer)
        cpu.no_dynamo_step(optimizer)
        optimizer.ftcore_grad_buffers = grad_buffers(model, optimizer)
    return optimizer


def expert_norm_over_expert_tp(optimizer) -> None:
    """The expert parameters' optimizer counts a replicated gradient in the norm once per expert
    TP group, not once per dense TP group.

    megatron counts a parameter in the gradient norm where it is `tensor_model_parallel` or where
    the optimizer's `tp_group` rank is 0, and sets `tp_group` to the dense TP group for the expert
    optimizer too. Its own expert weights are all `tensor_model_parallel`, so that never matters
    there; expert adapters have factors replicated over the expert TP group (peft/experts.py), and
    at ep x tp (etp 1) the experts of the dense TP ranks other than 0 were left out of the norm
    (and of the clipping that uses it). Their own TP group is the expert TP group."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        groups = getattr(getattr(opt, "optimizer", None), "param_groups", None) or []
        if groups and all(g.get("is_expert_parallel", False) for g in groups):
            opt.tp_group = parallel_state.get_expert_tensor_parallel_group()


def grad_buffers(model: list, optimizer) -> list[torch.Tensor] | None:
    """The DDP grad buffers, where they hold exactly the optimizer's gradients, unsplit: fp32
    optimizers (no distributed optimizer) on a model-parallel world of one. The norm and the clip
    are then a kernel per buffer instead of megatron's per-parameter Python (CPU LoRA benchmark:
    ~1.5 ms of an ~85 ms step). None where that does not hold."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if any(type(o).__name__ != "FP32Optimizer" for o in chained):
        return None
    ps = parallel_state
    if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size()) != (1, 1, 1, 1):  # fmt: skip
        return None
    buffers = [b for chunk in model for b in (*chunk.buffers, *chunk.expert_parallel_buffers)]
    in_buffers = {id(p) for b in buffers for p in b.params}
    trained = {id(p) for o in chained for g in o.optimizer.param_groups for p in g["params"]}
    return [b.grad_data for b in buffers] if in_buffers == trained and trained else None


def grad_norm(optimizer) -> float:
    """The global L2 norm of the gradients (after prepare_grads), as megatron's get_grad_norm."""
    buffers = getattr(optimizer, "ftcore_grad_buffers", None)
    if buffers is None:
        return float(optimizer.get_grad_norm() or 0.0)
    # accumulated in float64: one fp32 reduction over a whole buffer drifts ~3e-6 (relative) from
    # megatron's per-parameter norms
    squares = sum(torch.linalg.vector_norm(b, dtype=torch.float64) ** 2 for b in buffers)
    return float(squares) ** 0.5


def build_scheduler(cfg: DictConfig, optimizer) -> OptimizerParamScheduler:
    """megatron's schedule, read at the step being taken: the trainer advances it just before
    each update, so step k (1-based) trains at its value at k. The warm-up rises from 0 (before
    step 1) to optim.lr at step sched.warmup_steps, so step 1 trains at optim.lr / warmup_steps
    (megatron's and HF's loops, stepping the schedule after the update, train their first step
    at lr 0); the decay reaches sched.min_lr at step train.max_steps. The run's own settings,
    not the checkpoint's, set the schedule on resume (only the step count comes from there)."""
    s = cfg.sched
    if s.name not in ("cosine", "linear", "constant"):
        raise FtcoreError(
            f"unknown schedule {s.name!r}", field="sched.name", fix="cosine, linear or constant"
        )
    steps = cfg.train.max_steps
    warmup = warmup_steps(cfg)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else cfg.optim.lr,
        max_lr=cfg.optim.lr,
        min_lr=s.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(steps, warmup + 1),
        lr_decay_style=s.name,
        start_wd=cfg.optim.weight_decay,
        end_wd=cfg.optim.weight_decay,
        wd_incr_steps=max(steps, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def warmup_steps(cfg: DictConfig) -> int:
    """sched.warmup_steps, scaled to the run: a warm-up longer than train.max_steps would never
    reach optim.lr (a short trial run of a long recipe, or train.epochs on little data), so it
    ends at the last step instead, and the log says so."""
    warmup, steps = cfg.sched.warmup_steps, cfg.train.max_steps
    if warmup <= steps:
        return warmup
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        log.warning("sched.warmup_steps=%d is longer than the run (train.max_steps=%d): the warm-up "
                    "is scaled to the run, the lr rising to optim.lr=%.3e at step %d (step 1: %.3e)",
                    warmup, steps, cfg.optim.lr, steps, cfg.optim.lr / max(steps, 1))  # fmt: skip
    return steps


def _clip_buffers(buffers: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """megatron's clip_grad_by_total_norm_fp32 on whole grad buffers."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if max_norm > 0.0 and coeff < 1.0:
        for b in buffers:
            b.mul_(coeff)


def step_with_norm(optimizer, grad_norm: float) -> bool:
    """The rest of megatron's ChainedOptimizer.step once the trainer has run prepare_grads and
    get_grad_norm (to skip non-finite steps before any update): clip by that norm, then update.
    Calling step() instead would prepare the gradients and compute their norm a second time."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    buffers = getattr(optimizer, "ftcore_grad_buffers", None)
    if buffers is not None:
        _clip_buffers(buffers, chained[0].config.clip_grad, grad_norm)
    else:
        for opt in chained:
            if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
                continue
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(
                    params,
                    max_norm=opt.config.clip_grad,
                    total_norm=grad_norm,
                    use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
    # FP32Optimizer's update is torch's AdamW alone: it needs none of the CPU device mode, whose
    # Python hook would otherwise run on each of its ~4 torch calls per parameter
    plain = all(type(o).__name__ == "FP32Optimizer" for o in chained)
    with cpu.mode_suspended() if plain else contextlib.nullcontext():
        return bool(optimizer.step_with_ready_grads())
