"""Checkpoints with megatron-core dist_checkpointing: synchronous on CPU, published atomically.

Layout (DESIGN.md): `<run.dir>/checkpoints/step_<N>/` is complete or absent (written under a
temporary name, then renamed); `checkpoints/latest` holds `step_<N>` and is replaced atomically.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps

from ftcore.errors import FtcoreError
from ftcore.runtime import cpu

log = logging.getLogger("ftcore")


def ckpt_root(state) -> Path:
    return state.run_dir / "checkpoints"


def exists(state, step: int) -> bool:
    return (ckpt_root(state) / f"step_{step}").is_dir()


def _sync_writer() -> None:
    """megatron's filesystem writer collects results through a `spawn` Manager queue, which hangs
    on CPU; a fork-context queue carries the same results synchronously."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if cpu.is_active() and filesystem_async._results_queue is None:
        filesystem_async._results_queue = mp.get_context("fork").Queue()


def _model_sharded_state_dict(state) -> dict:
    out = {}
    for i, chunk in enumerate(state.model):
        key = "model" if len(state.model) == 1 else f"model{i}"
        out[key] = chunk.sharded_state_dict()
    return out


def _sharded_state_dict(state, *, is_loading: bool) -> dict:
    sd = _model_sharded_state_dict(state)
    sd["optimizer"] = state.optimizer.sharded_state_dict(
        _model_sharded_state_dict(state), is_loading=is_loading
    )
    sd["scheduler"] = state.scheduler.state_dict()
    sd["progress"] = {"step": state.step, "consumed_samples": state.consumed_samples}
    return sd


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(state) -> Path:
    """Write step_<N> under a temporary name, rename it, then point `latest` at it."""
    _sync_writer()
    root = ckpt_root(state)
    final = root / f"step_{state.step}"
    tmp = root / f".tmp_step_{state.step}"
    if state.info.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    with cpu.device_mode():
        dist_checkpointing.save(_sharded_state_dict(state, is_loading=False), str(tmp))
    _barrier()
    if state.info.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _publish_latest(root, final.name)
        log.info("saved checkpoint %s", final)
    _barrier()
    return final


def _publish_latest(root: Path, name: str) -> None:
    tmp = root / ".latest.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / "latest")


def resolve(state) -> Path | None:
    """The checkpoint to resume from: checkpoint.resume = auto | never | PATH."""
    how = state.cfg.checkpoint.resume
    if how == "never":
        return None
    if how != "auto":
        path = Path(how)
        if not path.is_dir():
            raise FtcoreError(f"no checkpoint directory at {path}", field="checkpoint.resume")
        return path
    latest = ckpt_root(state) / "latest"
    if not latest.exists():
        return None
    path = ckpt_root(state) / latest.read_text().strip()
    if not path.is_dir():
        raise FtcoreError(
            f"{latest} points at {path.name}, which does not exist",
            field="checkpoint.resume",
            fix="point checkpoints/latest at a complete step_<N> directory, or checkpoint.resume=never",
        )
    return path


def maybe_resume(state) -> None:
    path = resolve(state)
    if path is None:
        return
    _sync_writer()
    with cpu.device_mode():
        loaded = dist_checkpointing.load(_sharded_state_dict(state, is_loading=True), str(path))
    for i, chunk in enumerate(state.model):
        chunk.load_state_dict(loaded["model" if len(state.model) == 1 else f"model{i}"])
    with cpu.device_mode():
        state.optimizer.load_state_dict(loaded["optimizer"])
    state.scheduler.load_state_dict(loaded["scheduler"])
    state.step = int(loaded["progress"]["step"])
    state.consumed_samples = int(loaded["progress"]["consumed_samples"])
    log.info("resumed from %s at step %d (tp=%d pp=%d)", path, state.step,
             ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())  # fmt: skip
    torch.manual_seed(state.cfg.run.seed + state.step)
