"""The dry build (`python -m ftcore.plan plan.dry_build=true`): build each distinct pipeline stage of
the job on the meta device, in this one CPU process, and check it against the planner.

Why: the GPU path builds with device="cuda" and moves the model with `.cuda()`, so a tensor that
ftcore creates without a device (e.g. an adapter born on the CPU) is found only when the first
forward crashes on the cluster. Here the same build code runs with "cuda" meaning meta
(`ftcore.runtime.cpu.meta_device`): whatever the GPU would hold is on meta and allocates nothing
(a 405B stage builds in seconds), and whatever is left on the CPU is named.

How: a fake process group of the job's world size (torch's FakeProcessGroup: collectives do
nothing) lets this process stand in for global rank `pp_rank * world / pp` (TP, CP and DP rank 0,
megatron's rank order tp-cp-ep-dp-pp); megatron's parallel state is built over it without its gloo
side groups. Then ftcore's own `build_model` (no init: meta has no values), `apply_peft`,
`wrap_ddp` and `build_optimizer`, as `ftcore.training.trainer.setup` calls them, with the configured
distributed optimizer. What is off the device is named as the model was built, before DDP (whose
buffer would move a straggler onto the GPU when the distributed optimizer is on, and which cannot
move it from the CPU to meta), then moved to meta so that DDP and the optimizer are still built
and checked. Without Transformer Engine the build uses the local layer spec (FP8/FP4 weights are
then counted as the elements they are; a CP layout is built as its DP equivalent); QLoRA's NF4
weights count their logical elements.

Each stage gives {pp_rank, params, planned_params, off_device}; `check` raises FtcoreError (exit 2)
naming what is off the device or the stages whose count differs from the planner's.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from omegaconf import DictConfig
from torch.testing._internal.distributed.fake_pg import FakeStore

from ftcore.errors import FtcoreError
from ftcore.models.builder import build_model, wrap_ddp
from ftcore.peft.lora import apply_peft
from ftcore.planner.params import rank_params
from ftcore.precision import recipes
from ftcore.runtime import cpu
from ftcore.runtime.dist import init_model_parallel
from ftcore.training.optim import build_optimizer

log = logging.getLogger("ftcore")

BUILD_DEVICE = "meta"
# plain tensors megatron keeps on the host on purpose: the MoE all-to-all dispatcher's chunk
# orders, index tensors for host-side sorting by host split sizes (on the device only with TE's
# fused permutation, moe_permute_fusion)
HOST_BY_DESIGN = ("sort_input_by_local_experts", "restore_output_by_local_experts")


def stages_to_build(pp: int) -> list[int]:
    """The distinct pipeline ranks: the first (embedding), one middle rank (all middle ranks hold
    the same layers, only numbered differently) and the last (final norm, output layer)."""
    return sorted({0, pp - 1} | ({1} if pp > 2 else set()))


def planned_params(cfg: DictConfig, pp_rank: int) -> int:
    """The planner's element count for one rank (all its virtual stages), as memory.py sums it."""
    return sum(p.numel for chunk in rank_params(cfg, pp_rank) for p in chunk)


@contextlib.contextmanager
def fake_world(cfg: DictConfig, world: int, pp_rank: int):
    """This process as global rank `pp_rank * world / pp` of a fake process group of `world` ranks,
    with megatron's parallel state of the job's layout."""
    if dist.is_initialized():
        raise FtcoreError(
            "the dry build needs a process of its own (a process group already exists)",
            field="plan.dry_build",
            fix="run `python -m ftcore.plan ... plan.dry_build=true` outside torchrun/srun",
        )
    rank = pp_rank * (world // cfg.parallel.pp)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        init_model_parallel(cfg, world, gloo_groups=False)
        where = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                 ps.get_context_parallel_rank(), ps.get_data_parallel_rank())  # fmt: skip
        assert where == (pp_rank, 0, 0, 0), f"rank {rank} is (pp, tp, cp, dp) = {where}"
        yield
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()


def build_stage(cfg: DictConfig, world: int, pp_rank: int) -> dict:
    """Build one pipeline rank on meta as the GPU path would; count and locate what it holds."""
    with fake_world(cfg, world, pp_rank), cpu.meta_device():
        with cpu.device_mode():
            model_parallel_cuda_manual_seed(cfg.run.seed)  # the RNG tracker megatron's init forks
        chunks = build_model(cfg, init=False)
        if cfg.peft.name != "none":
            apply_peft(cfg, chunks)
        born_off = off_device(chunks)
        _move_to_meta(chunks)
        model = wrap_ddp(cfg, chunks)
        optimizer = build_optimizer(cfg, model, gloo_groups=False)
        later_off = off_device(chunks) + optimizer_off_device(optimizer)
        return {
            "pp_rank": pp_rank,
            "params": count(chunks),
            "planned_params": planned_params(cfg, pp_rank),
            "off_device": born_off + [n for n in later_off if n not in born_off],
        }


def _move_to_meta(chunks: list) -> None:
    """Put parameters and buffers found off the device on meta, keeping their attributes
    (tensor_model_parallel, sequence_parallel, ...), so that DDP can still be built and checked.
    On a GPU with the distributed optimizer DDP's buffer would move them (and hide the bug: without
    it they stay on the CPU); here set_data from the CPU to meta is refused, so they move first."""
    for chunk in chunks:
        for m in chunk.modules():
            for name, p in list(m._parameters.items()):
                if p is not None and p.device.type != BUILD_DEVICE:
                    moved = torch.nn.Parameter(p.to(BUILD_DEVICE), requires_grad=p.requires_grad)
                    moved.__dict__.update(p.__dict__)
                    m._parameters[name] = moved
            for name, b in list(m._buffers.items()):
                if b is not None and b.device.type != BUILD_DEVICE:
                    m._buffers[name] = b.to(BUILD_DEVICE)


def count(model: list) -> int:
    """Elements of this rank's parameters, each counted once (NF4 weights: logical elements)."""
    seen: dict[int, int] = {}
    for chunk in model:
        for p in chunk.parameters():
            seen[id(p)] = getattr(p, "logical_numel", p.numel())
    return sum(seen.values())


def off_device(model: list) -> list[str]:
    """Names of parameters, their DDP gradient buffers (`main_grad`), buffers and plain tensor
    attributes of modules (which `.cuda()` does not move) that are not on the build device."""
    out = []
    for i, chunk in enumerate(model):
        pre = f"{i}." if len(model) > 1 else ""
        for name, p in chunk.named_parameters():
            if p.device.type != BUILD_DEVICE:
                out.append(pre + name)
            grad = getattr(p, "main_grad", None)
            if grad is not None and grad.device.type != BUILD_DEVICE:
                out.append(f"{pre}{name}.main_grad")
        for name, b in chunk.named_buffers():
            if b.device.type != BUILD_DEVICE:
                out.append(pre + name)
        for mname, m in chunk.named_modules():
            for attr, t in _plain_tensors(vars(m)):
                if t.device.type != BUILD_DEVICE and attr.rsplit(".", 1)[-1] not in HOST_BY_DESIGN:
                    out.append(f"{pre}{mname}.{attr}" if mname else pre + attr)
    return out


def _plain_tensors(attrs: dict, depth: int = 2):
    """(name, tensor) of a module's plain attributes: tensors, and tensors inside plain objects
    such as bitsandbytes' QuantState (absmax, code, its nested state2), two levels deep."""
    for name, v in attrs.items():
        if isinstance(v, torch.Tensor):  # parameters and buffers live in _parameters/_buffers
            yield name, v
        elif depth and hasattr(v, "__dict__") and not isinstance(v, torch.nn.Module | type):
            for sub, t in _plain_tensors(vars(v), depth - 1):
                yield f"{name}.{sub}", t


def optimizer_off_device(optimizer) -> list[str]:
    """The optimizer's own parameters (fp32 main params, distributed-optimizer shards) not on the
    build device, as `optimizer.<i>.param_groups.<g>.<j>` (i: megatron's chained optimizer)."""
    out = []
    for i, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        for g, group in enumerate(opt.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if p.device.type != BUILD_DEVICE:
                    out.append(f"optimizer.{i}.param_groups.{g}.{j}")
    return out


def dry_build(cfg: DictConfig, world: int) -> list[dict]:
    """One entry per distinct pipeline stage (see `build_stage`)."""
    build_cfg = _without_te_cp(cfg)
    return [build_stage(build_cfg, world, r) for r in stages_to_build(cfg.parallel.pp)]


def _without_te_cp(cfg: DictConfig) -> DictConfig:
    """megatron's local attention refuses context parallelism (only TE's supports it). CP shards
    no parameter and megatron's dp x cp group keeps its size, so without TE a CP layout is built as
    its data-parallel equivalent: the same parameters, the same DDP buffers."""
    if cfg.parallel.cp == 1 or recipes.te_version() is not None:
        return cfg
    log.warning(
        "dry build: no Transformer Engine, so parallel.cp=%d is built as dp", cfg.parallel.cp
    )
    folded = copy.deepcopy(cfg)
    folded.parallel.cp = 1
    return folded


def check(entries: list[dict]) -> None:
    """FtcoreError (exit 2) naming what is off the device and every count that differs."""
    problems = []
    for e in entries:
        if e["off_device"]:
            names = e["off_device"]
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            problems.append(f"pp stage {e['pp_rank']}: {len(names)} not on the device: {shown}")
        if e["params"] != e["planned_params"]:
            problems.append(
                f"pp stage {e['pp_rank']}: built {e['params']:,d} elements, the planner counts "
                f"{e['planned_params']:,d}"
            )
    if problems:
        raise FtcoreError(
            "dry build: " + "; ".join(problems),
            field="plan.dry_build",
            fix="every parameter and buffer must be created on the device of the layer it "
            "belongs to, and the planner (ftcore/planner/params.py) must count what is built",
        )
