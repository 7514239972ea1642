"""Distributed start and stop: one process, torchrun, srun, or N local workers started here.

- under torchrun (RANK/WORLD_SIZE set) or srun (SLURM_PROCID with MASTER_ADDR set): join;
- alone with `launcher.nproc_per_node > 1`: start that many workers (runtime/local_launch.py) and
  wait for them; a stop signal is forwarded, the first failure stops all;
- alone with one worker: a one-process group on an in-process store (no TCP listener).
Then megatron's parallel state (tp, pp, vp, cp; dp is whatever is left).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from ftcore.errors import FtcoreError
from ftcore.planner import cp

log = logging.getLogger("ftcore")

GPU_BACKEND = "nccl"  # the default group's backend on CUDA; it takes CUDA tensors only
# Where ftcore puts the tensors of its own collectives: this rank's CUDA device under NCCL, the
# CPU under gloo (the default). Set by init_distributed on CUDA; comm_device() is the one reader.
_comm_device = torch.device("cpu")


@dataclass
class DistInfo:
    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device


def under_launcher() -> bool:
    """True when torchrun, srun or our own local launch already started this process as a rank."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return (
        "SLURM_PROCID" in os.environ
        and "MASTER_ADDR" in os.environ
        and "SLURM_NTASKS" in os.environ
    )


def _env_from_slurm() -> None:
    """srun with one task per device: map SLURM's variables onto torch's."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ["LOCAL_WORLD_SIZE"] = os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    os.environ.setdefault("MASTER_PORT", "29500")


def cpu_threads(local_world: int) -> int:
    """Torch threads per rank: OMP_NUM_THREADS when a launcher set it, else this process's CPUs
    (its affinity, not the machine's count) shared among the ranks of this node."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_world))


def launch_standalone(
    cfg: DictConfig, module: str, check: Callable[[DictConfig, int], object]
) -> int | None:
    """The entry points' first step. Under torchrun/srun: None (run as this rank). Alone: `check(cfg,
    nproc)` (the entry point's config checks, validate.check_for_launch) before megatron is imported
    or any worker starts, so bad input exits 2 fast; training then locks its run.dir
    (runtime/run_lock.py: exit 2 if a live run uses it); then None for one process, or start
    `launcher.nproc_per_node` workers of `python -m module` with one run.dir for all ranks and
    return their exit status."""
    if under_launcher():
        return None
    nproc = cfg.launcher.nproc_per_node
    check(cfg, nproc)
    from ftcore.runtime import run_lock

    training = module == "ftcore.train"  # eval and generate write no checkpoints: no lock
    run_dir = decide_run_dir(cfg, module.rsplit(".", 1)[-1])
    if nproc == 1:
        if training:  # exit 2 naming the holder if a live run uses run.dir; the entry point
            cfg.run.dir = run_dir  # releases it (train.py)
            run_lock.acquire(run_dir)
        return None
    argv = [a for a in sys.argv[1:] if not a.startswith("run.dir=")]
    argv.append(f"run.dir={run_dir}")
    lock = run_lock.acquire(run_dir) if training else None  # the workers inherit it
    try:
        return launch_local_workers(module, argv, nproc, cfg, lock)
    finally:
        run_lock.release()


def launch_local_workers(module: str, argv: list[str], nproc: int, cfg=None, lock=None) -> int:
    """Start `python -m module argv` as `nproc` local ranks (runtime/local_launch.py); return the
    exit status: a worker's own 2 (user error) or 3 (saved, requeue) becomes ours. `lock`: the
    run directory's (runtime/run_lock.py), which the workers inherit."""
    from ftcore.runtime import local_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(cpu_threads(nproc)))
    if cfg is not None and cfg.cluster.device != "cpu":
        from ftcore.runtime import gpu_env

        gpu_env.apply(os.environ, cfg)  # per GPU generation and overlap setting
    with tempfile.TemporaryDirectory(prefix="ftcore-errors-") as errors:
        # Workers leave their user error here instead of printing it (ftcore.cli), so that it is
        # shown once, as the last line on screen.
        os.environ[ERROR_DIR_ENV] = errors
        try:
            return local_launch.run(module, argv, nproc, Path(errors), lock=lock)
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)


ERROR_DIR_ENV = "FTCORE_WORKER_ERROR_DIR"


def init_distributed(cfg: DictConfig) -> DistInfo:
    """Join or create the process group (NCCL on GPU, gloo on CPU). The CUDA device is set before
    the group exists: NCCL's object collectives and barriers use the current device."""
    global _comm_device
    _env_from_slurm()
    # Alone: an in-process store, no TCP listener at all (torch's TCPStore listens on every
    # interface, unauthenticated), and gloo's own sockets on the loopback interface.
    store = None
    if "RANK" not in os.environ:
        from ftcore.runtime.local_launch import loopback_env

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.update(loopback_env(dict(os.environ)))
        store = dist.HashStore()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = torch.cuda.is_available() and cfg.cluster.device != "cpu"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = _comm_device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        threads = cfg.launcher.threads_per_rank or cpu_threads(local_world)
        torch.set_num_threads(threads)
    if not dist.is_initialized():
        # device_id: NCCL binds this rank's GPU now instead of guessing it from the global rank
        # for barriers (torch warned of a possible hang on the H200 run, docs/gpu/), creates the
        # communicator eagerly and splits megatron's groups from it
        dist.init_process_group(
            backend=GPU_BACKEND if use_cuda else "gloo",
            rank=rank,
            world_size=world,
            store=store,
            timeout=datetime.timedelta(
                minutes=int(os.environ.get("FTCORE_DIST_TIMEOUT_MIN", "30"))
            ),
            device_id=device if use_cuda else None,
        )
    return DistInfo(rank, world, local_rank, local_world, device)


def comm_device() -> torch.device:
    """The device of the tensors ftcore hands to a collective on the default group or megatron's
    groups: NCCL takes CUDA tensors only ("No backend type associated with device type cpu"), gloo
    CPU ones. (megatron's *_gloo groups take CPU tensors on any machine.)"""
    return _comm_device


def set_comm_device(device: torch.device, shadow: bool = False) -> torch.device:
    """Replace comm_device()'s answer; returns the previous one. For the device audit, which plays
    the GPU path's init on the CPU (runtime/device_audit.py): `shadow`, its stand-in for a CUDA
    device, which `is_cuda` then answers as one."""
    global _comm_device, _shadow_cuda
    previous, _comm_device = _comm_device, device
    _shadow_cuda = device if shadow else None
    return previous


_shadow_cuda = None


def is_cuda(device) -> bool:
    """A CUDA device, or the device audit's stand-in for one (a CPU device object it knows)."""
    return device is not None and (device is _shadow_cuda or torch.device(device).type == "cuda")


def init_model_parallel(cfg: DictConfig, world: int, *, gloo_groups: bool = True) -> None:
    """megatron's parallel state. `gloo_groups=False` skips its gloo side groups (the dry build's
    fake process group cannot create gloo groups, and builds nothing that uses them)."""
    from megatron.core import parallel_state as ps

    p = cfg.parallel
    if world % (p.tp * p.pp * p.cp):
        raise FtcoreError(
            f"world size {world} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp}",
            field="parallel.tp/pp/cp",
            fix="launch a multiple of tp*pp*cp processes",
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vp if p.vp > 1 else None,
        context_parallel_size=p.cp,
        hierarchical_context_parallel_sizes=cp.hierarchical_sizes(p),
        # expert groups (MoE; both 1 for a dense model): ep·etp·pp must divide the world
        expert_model_parallel_size=p.get("ep", 1),
        expert_tensor_parallel_size=p.get("etp", 1),
        create_gloo_process_groups=gloo_groups,
    )


def decide_run_dir(cfg: DictConfig, kind: str = "train") -> str:
    """outputs/<exp>/<job id or timestamp> for training, outputs/<exp>/<kind>/<...> for eval and
    generate (so they never sit among the training runs): decided once (rank 0, or the launching
    parent)."""
    if cfg.run.dir:
        return cfg.run.dir
    job = os.environ.get("SLURM_JOB_ID") or time.strftime("%Y%m%d-%H%M%S")
    sub = () if kind == "train" else (kind,)
    return str(Path("outputs", cfg.run.exp, *sub, job))


def teardown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
