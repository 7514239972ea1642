"""What a checkpoint holds, and how a run is put back exactly where it was.

A checkpoint is one megatron `dist_checkpointing` state dict:
- `model` (or `model0..` per virtual stage): sharded tensors under layout-independent keys, so
  they reshard across TP/PP on load. With PEFT only the trainable (adapter) tensors are saved: the
  frozen base comes back from `model.hf_path`/`init_path` at setup;
- `optimizer`: megatron's sharded optimizer state, model-space tensors for the regular and the
  distributed optimizer alike (`optim_format`), so it reshards across TP/PP/vp/DP too;
- common (rank 0 writes it): scheduler, progress (step, consumed samples, skipped bad steps), the
  layout, the config, the wandb run id, the data position of every DP rank and the RNG states of
  every rank (gathered, so every rank holds the same lists).
RNG states only make sense on the same layout; the data position is global (docs/checkpoints.md), so it
carries over to any DP size when all DP ranks agree on it.
"""

from __future__ import annotations

import contextlib
import logging
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from omegaconf import OmegaConf

from ftcore.errors import FtcoreError
from ftcore.models.sharding import unwrap
from ftcore.runtime import collectives, safe_files

log = logging.getLogger("ftcore")


def layout() -> dict:
    return {
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def adapter_only(cfg) -> bool:
    return cfg.peft.name != "none"


def _chunk_key(state, i: int) -> str:
    return "model" if len(state.model) == 1 else f"model{i}"


def model_sharded_state_dict(state) -> dict:
    """Every chunk's sharded state dict; with PEFT, frozen base parameters are left out."""
    out = {}
    for i, chunk in enumerate(state.model):
        sd = unwrap(chunk).sharded_state_dict()  # the bare GPTModel: keys independent of wrappers
        if adapter_only(state.cfg):
            frozen = _param_names(chunk, trainable=False)
            sd = {k: v for k, v in sd.items() if k not in frozen}
        out[_chunk_key(state, i)] = sd
    return out


def _param_names(chunk, *, trainable: bool) -> set[str]:
    return {n for n, p in unwrap(chunk).named_parameters() if p.requires_grad == trainable}


def optim_format(cfg) -> str:
    """How the optimizer state is laid out. megatron's regular optimizer keeps it in model space
    (reshards like the weights). The distributed optimizer is saved `fully_reshardable`: its flat
    DP buffers gathered back into model-space tensors (one per parameter and state, sharded like
    the parameter), so it too reshards across TP, PP, vp and DP. Checkpoints written before used
    `dp_reshardable` (the raw DP buffers: reshard across DP only); they still load at their layout."""
    return "fully_reshardable" if cfg.parallel.distributed_optimizer else "model_space"


def optimizer_metadata(fmt: str) -> dict:
    """megatron's `metadata` for `sharded_state_dict`, saving or loading a checkpoint of `fmt`
    (as megatron-LM's training/checkpointing builds it). Not the memory-efficient variant: it
    gathers over gloo to DP rank 0 only, so a save cannot spread over the DP ranks, and a load
    reads the whole TP/PP shard on every rank either way. The regular optimizer ignores the type;
    its metadata stays as it always was (it decides a chained optimizer's key prefixes)."""
    if fmt == "model_space":
        return {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}
    return {
        "distrib_optim_sharding_type": fmt,
        "distrib_optim_fully_reshardable_mem_efficient": False,
        "chained_optim_avoid_prefix": True,
    }


def optimizer_loadable(cfg, common: dict) -> str | None:
    """None if the saved optimizer state loads into this run, else why not (said as a warning:
    weights, schedule and data position still load; Adam moments restart from zero)."""
    saved, now = common["optim_format"], optim_format(cfg)
    if saved == "dp_reshardable" and now == "fully_reshardable":
        lay_saved, lay_now = common["layout"], layout()
        if all(lay_saved[k] == lay_now[k] for k in ("tp", "pp", "vp")):
            return None  # an older checkpoint at its own layout: loads in its own format
        return (f"optimizer state not restored: this checkpoint is in the older dp_reshardable format, "
                f"which reshards across DP only (saved at {_fmt(lay_saved)}, now {_fmt(lay_now)}); "
                "Adam moments restart from zero. Resume at the saved tp/pp/vp to keep them: "
                "checkpoints saved from then on reshard to any layout")  # fmt: skip
    if saved != now:
        return (f"optimizer state not restored: saved in the {saved} format, this run uses {now} "
                "(parallel.distributed_optimizer changed); Adam moments restart from zero")  # fmt: skip
    return None


def _all_gather(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    collectives.all_gather_object(out, obj)
    return out


def rng_state() -> dict:
    states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_state(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _keeps_step_per_param(inner) -> bool:
    """torch's Adam/AdamW keep a `step` tensor in each parameter's state; TE's and Apex's
    FusedAdam keep it in the param group, and TE's state_dict() looks every state name up in a
    table of exp_avg, exp_avg_sq and master_param: a `step` there is a KeyError, at this load and
    at every save after it (TE 2.9, transformer_engine/pytorch/optimizers/fused_adam.py)."""
    return isinstance(inner, torch.optim.Adam | torch.optim.AdamW)


def _init_distributed_optimizer_state(optimizer) -> None:
    """A fresh distributed optimizer has no Adam state yet, and megatron's loading path reads it
    (with torch Adam's per-parameter `step`) before filling it: create the zero state first, as a
    first step would."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        if (
            isinstance(o, DistributedOptimizer)
            and o.init_state_fn is not None
            and not o.optimizer.state
        ):
            o.init_state_fn(o.optimizer, o.config)
            if _keeps_step_per_param(o.optimizer):
                for st in o.optimizer.state.values():
                    st.setdefault("step", torch.tensor(0.0))


@contextlib.contextmanager
def _torch_adam_steps(optimizer):
    """Two gaps in megatron's distributed-optimizer load when the inner optimizer is torch's Adam
    (megatron without Apex/TE, and ftcore on CPU), which keeps a `step` tensor per parameter
    where Apex/TE's FusedAdam keeps it in the param group:
    - the fully_reshardable load copies every key of a parameter's state from the checkpoint, which
      has no per-tensor step (KeyError 'step'): each parameter is offered its own, restored from
      the param groups just before, so that key is copied onto itself;
    - every parameter's state gets the *same* step tensor, which Adam then increments once per
      parameter per step (wrong bias correction from the first step on): after the load each
      parameter gets a tensor of its own, holding its param group's step."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    dist_opts = [
        o
        for o in getattr(optimizer, "chained_optimizers", [optimizer])
        if isinstance(o, DistributedOptimizer)
    ]
    for o in dist_opts:
        set_states = o._set_main_param_and_optimizer_states

        def with_step(model_param, tensors, o=o, set_states=set_states):
            now = o._get_main_param_and_optimizer_states(model_param)
            if "step" in now and "step" not in tensors:
                tensors = {**tensors, "step": now["step"]}
            set_states(model_param, tensors)

        o._set_main_param_and_optimizer_states = with_step
    try:
        yield
    finally:
        for o in dist_opts:
            del o._set_main_param_and_optimizer_states  # back to the class's method
    for o in dist_opts:
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                st = o.optimizer.state.get(p, {})
                if "step" in st and "step" in group:
                    st["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def sharded_state_dict(state, *, is_loading: bool, optim: str | None = None) -> dict:
    """The whole checkpoint as a (sharded) state dict; the optimizer's in format `optim` (None:
    leave the optimizer out). Collective: the distributed optimizer gathers its DP shards."""
    from ftcore.runtime import cpu

    cfg = state.cfg
    sd = model_sharded_state_dict(state)
    if optim is not None:
        if is_loading:
            _init_distributed_optimizer_state(state.optimizer)
        with cpu.device_mode():  # the gather stages its buffers on the current (CUDA) device
            sd["optimizer"] = state.optimizer.sharded_state_dict(
                model_sharded_state_dict(state),
                is_loading=is_loading,
                metadata=optimizer_metadata(optim),
            )
    sd["scheduler"] = state.scheduler.state_dict()
    if is_loading:
        return sd
    loader = (
        state.loader.state_dict()
        if state.loader is not None and hasattr(state.loader, "state_dict")
        else None
    )
    gathered = _all_gather(
        {"rng": rng_state(), "loader": loader, "dp_rank": ps.get_data_parallel_rank()}
    )
    wandb_file = state.run_dir / "wandb_id"
    sd["ftcore"] = {
        "step": state.step,
        "consumed_samples": state.consumed_samples,
        "bad_steps": state.bad_steps,
        "layout": layout(),
        "optim_format": optim_format(cfg),
        "adapter_only": adapter_only(cfg),
        "config": OmegaConf.to_yaml(cfg, resolve=True),  # holds no interpolation (safe_files)
        "wandb_id": _wandb_id(wandb_file),
        "rng": [g["rng"] for g in gathered],
        "loader": _loader_states(gathered),
    }
    return sd


def _wandb_id(path) -> str | None:
    """The wandb run id metrics.py wrote into run.dir (this run's), if any."""
    if not path.is_file():
        return None
    return safe_files.read_text(path, "run.dir", root=path.parent, limit=256).strip()


def _loader_states(gathered: list[dict]) -> list | None:
    """One data position per DP rank (index = DP rank); None when the run has no loader state."""
    by_dp: dict[int, object] = {}
    for g in gathered:
        by_dp.setdefault(g["dp_rank"], g["loader"])
    if all(v is None for v in by_dp.values()):
        return None
    return [by_dp[i] for i in sorted(by_dp)]


def restore(
    state, loaded: dict, path, optimizer_note: str | None = None, *, new_data: bool = False
) -> list[str]:
    """Put a loaded checkpoint into the run; returns what could not be carried over (warnings).
    The run's own optimizer settings and schedule apply from here on (checkpoint/changes.py);
    `new_data`: the data stream changed (checkpoint.allow_changed), so it starts at its beginning."""
    from ftcore.runtime import cpu

    common = loaded["ftcore"]
    notes = [optimizer_note] if optimizer_note else []
    for i, chunk in enumerate(state.model):
        part = loaded[_chunk_key(state, i)]
        if adapter_only(state.cfg):
            missing, unexpected = unwrap(chunk).load_state_dict(part, strict=False)
            trainable = _param_names(chunk, trainable=True)
            lost = [k for k in missing if k in trainable]
            if lost or unexpected:
                raise FtcoreError(f"adapter checkpoint {path} does not match this model: missing {lost[:3]}, "
                                  f"unexpected {list(unexpected)[:3]}", field="peft",
                                  fix="resume with the peft settings it was saved with")  # fmt: skip
        else:
            unwrap(chunk).load_state_dict(part)
    own = _group_settings(state.optimizer)  # the run's own values apply from here on
    with cpu.device_mode(), torch.no_grad():  # the distributed optimizer copies into fp32 params
        if optimizer_note is None:
            with _torch_adam_steps(state.optimizer):
                state.optimizer.load_state_dict(loaded["optimizer"])
        else:
            state.optimizer.reload_model_params()  # fp32 main copies from the loaded weights
    for group, settings in zip(state.optimizer.param_groups, own, strict=True):
        group.update(settings)
    state.scheduler.load_state_dict(loaded["scheduler"])  # the step count; values are the run's
    state.step = int(common["step"])
    state.consumed_samples = int(common["consumed_samples"])
    state.bad_steps = int(common.get("bad_steps", 0))
    saved, now = common["layout"], layout()
    if saved == now:
        set_rng_state(common["rng"][dist.get_rank() if dist.is_initialized() else 0])
    else:
        notes.append(f"RNG states not restored (saved at {_fmt(saved)}, now {_fmt(now)}): dropout masks "
                     "will differ from an uninterrupted run; weights, optimizer and data position are resharded")  # fmt: skip
        torch.manual_seed(state.cfg.run.seed + state.step)
    if not new_data:
        _restore_loader(state, common.get("loader"), saved, path)
    _restore_wandb_id(state, common.get("wandb_id"))
    return notes


# What this run's config sets in each optimizer param group (megatron's max_lr/min_lr feed the
# schedule; Adam's betas and eps), which loading the optimizer's state would take from the checkpoint.
_GROUP_SETTINGS = ("max_lr", "min_lr", "wd_mult", "lr_mult", "betas", "eps", "weight_decay")


def _group_settings(optimizer) -> list[dict]:
    return [{k: g[k] for k in _GROUP_SETTINGS if k in g} for g in optimizer.param_groups]


def _restore_loader(state, states: list | None, saved: dict, path) -> None:
    if state.loader is None or not hasattr(state.loader, "load_state_dict"):
        return
    if states is None:
        raise FtcoreError(f"checkpoint {path} holds no data position", field="checkpoint.resume",
                          fix="resume with checkpoint.resume=never to start over")  # fmt: skip
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if len(states) == dp:
        state.loader.load_state_dict(states[dp_rank])
    elif all(s == states[0] for s in states):
        state.loader.load_state_dict(states[0])  # a global position: valid at any DP size
    else:
        raise FtcoreError(
            f"checkpoint {path} holds per-rank data positions for dp={saved['dp']} that differ; "
            f"they cannot be resharded to dp={dp}",
            field="parallel",
            fix=f"resume at dp={saved['dp']} (tp·pp·cp = world / {saved['dp']})",
        )


def _restore_wandb_id(state, run_id: str | None) -> None:
    """A resumed run continues the same wandb run (metrics.py reads <run.dir>/wandb_id)."""
    path = state.run_dir / "wandb_id"
    if run_id and state.info.rank == 0 and not path.exists():
        safe_files.write_atomic(path, str(run_id))


def _fmt(lay: dict) -> str:
    return " ".join(f"{k}={lay[k]}" for k in ("world", "tp", "pp", "vp", "cp", "dp"))
