"""Checkpoints with megatron-core dist_checkpointing, published atomically; resume from `latest`.

Layout (docs/checkpoints.md): `<run.dir>/checkpoints/step_<N>/` is complete or absent; `checkpoints/latest`
holds `step_<N>` and is replaced atomically. A save writes `.tmp_step_<N>/`, verifies it (every
tensor whole, every file there), writes `manifest.json` (sizes + CRC32), renames it to `step_<N>`,
then replaces `latest`, then drops checkpoints beyond `checkpoint.keep`. A crash at any moment
leaves the previous `latest`. On GPU the tensor files are written in the background
(`checkpoint.async_save`) and the publish runs when every rank's writes are done; on CPU the
save is synchronous (megatron's async writer hangs there, see docs/cpu_runtime.md).
What the checkpoint holds and how a run is restored: ftcore/checkpoint/resume.py.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from ftcore.checkpoint import changes, files, resume
from ftcore.errors import FtcoreError
from ftcore.runtime import collectives, cpu, safe_files

log = logging.getLogger("ftcore")


def ckpt_root(state) -> Path:
    return state.run_dir / "checkpoints"


def exists(state, step: int) -> bool:
    """This run already holds a checkpoint of `step`: saved by it (published or still being
    written in the background) or resumed from it. A directory left by an earlier run in the same
    run.dir (checkpoint.resume=never) does not count: it is overwritten."""
    pending = state.extra.get("ckpt_pending")
    return (pending is not None and pending[0] == step) or state.extra.get("ckpt_published") == step


def _write_in_process(request) -> None:
    """CPU: run megatron's write plan synchronously in this process. Its writer forks one process
    per file bucket and collects results through a `spawn` Manager queue, which hangs on CPU (and
    daemonic workers may not fork); the same per-bucket writer, called here, writes the same files."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    fn = request.async_fn
    if fn is not None:
        if not (
            isinstance(fn, functools.partial)
            and fn.func.__name__ == "write_preloaded_data_multiproc"
        ):
            request.execute_sync()  # another megatron version: its own synchronous path
            return
        transform_list = fn.args[0]
        _rank, buckets, results_queue = request.async_fn_args
        if request.preload_fn is not None:
            buckets = request.preload_fn()
        results = {}
        for i, bucket in enumerate(buckets):
            local, count = queue.Queue(), queue.Queue()
            count.put(i)
            fa.FileSystemWriterAsync.write_preloaded_data(
                transform_list, i, bucket, local, count, True
            )
            idx, res = local.get()
            if isinstance(res, Exception):
                raise res
            results[idx] = res
        results_queue.put(results)
    _barrier()
    for finalize in request.finalize_fns:
        finalize()


def _in_process_results_queue() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if cpu.is_active() and not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def _barrier() -> None:
    if dist.is_initialized():
        collectives.barrier()


def _rank0(state) -> bool:
    return state.info.rank == 0


def _use_async(state) -> bool:
    return (
        bool(state.cfg.checkpoint.async_save) and torch.cuda.is_available() and not cpu.is_active()
    )


def save(state, *, blocking: bool = False) -> Path:
    """Checkpoint the current step. Collective. On GPU with async_save the write continues in the
    background unless `blocking`; `poll`/`wait` publish it."""
    wait(state)  # one save in flight at a time, published in order
    from ftcore.models.builder import params_current

    params_current(state.model)  # overlap_param_gather leaves the last update for the next forward
    root = ckpt_root(state)
    final = root / f"step_{state.step}"
    if exists(state, state.step):
        return final  # this run saved or resumed this very step
    tmp = root / f"{files.TMP_PREFIX}{state.step}"
    t0 = time.perf_counter()
    if _rank0(state):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    sd = resume.sharded_state_dict(state, is_loading=False, optim=resume.optim_format(state.cfg))
    background = _use_async(state)
    if not background:
        _in_process_results_queue()
    with cpu.device_mode():
        request = dist_checkpointing.save(sd, str(tmp), async_sharded_save=True)
    step = state.step
    request.add_finalize_fn(lambda: _publish(state, tmp, final, sd, step, t0))
    if not background:
        with cpu.device_mode():
            _write_in_process(request)
        return final
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    queue = state.extra.setdefault("ckpt_queue", AsyncCallsQueue())
    queue.schedule_async_request(request)
    state.extra["ckpt_pending"] = (step, final)
    if blocking:
        wait(state)
    return final


def _publish(state, tmp: Path, final: Path, sd: dict, step: int, t0: float) -> None:
    """Collective: verify, manifest, rename, point `latest` at it, apply `keep`."""
    files.verify_written(tmp, sd)
    if _rank0(state):
        safe_files.write_atomic(tmp / "config.yaml", _config_yaml(state))
    files.write_manifest(tmp, {"step": step, "layout": resume.layout(), "run_id": state.cfg.run.id})
    _barrier()
    if _rank0(state):
        safe_files.fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)  # an unpublished leftover of a crashed run
        os.replace(tmp, final)
        _publish_latest(final.parent, final.name)
        _apply_keep(state, step)
        log.info("saved checkpoint %s (%.1f s)", final, time.perf_counter() - t0)
    _barrier()
    state.extra["ckpt_published"] = step


def _config_yaml(state) -> str:
    """The run's config, its interpolations resolved: what ftcore writes holds none, and what it
    reads back from elsewhere may not (safe_files.run_config)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(state.cfg, resolve=True)


def _publish_latest(root: Path, name: str) -> None:
    tmp = root / ".latest.tmp"
    safe_files.write_exclusive(tmp, (name + "\n").encode())
    os.replace(tmp, root / "latest")
    safe_files.fsync_dir(root)


def _apply_keep(state, step: int) -> None:
    """Keep the newest `checkpoint.keep` checkpoints up to `step` (0 = all); drop leftovers of
    unfinished saves. Directories of later steps (an abandoned future after resume=PATH) stay."""
    keep = state.cfg.checkpoint.keep
    if ckpt_root(state).is_symlink():  # never delete through a link (safe_files.check_run_dir)
        return
    found = files.scan(ckpt_root(state))
    for d in found.incomplete:
        if d.name != f"{files.TMP_PREFIX}{step}":
            shutil.rmtree(d, ignore_errors=True)
    if keep > 0:
        older = [d for s, d in found.complete if s <= step]
        for d in older[:-keep]:
            shutil.rmtree(d, ignore_errors=True)
            log.info("removed checkpoint %s (checkpoint.keep=%d)", d, keep)


def poll(state) -> None:
    """Collective, at each step boundary: publish a background save that has finished."""
    queue = state.extra.get("ckpt_queue")
    if queue is not None and queue.get_num_unfinalized_calls():
        queue.maybe_finalize_async_calls(blocking=False)
        if not queue.get_num_unfinalized_calls():
            state.extra["ckpt_pending"] = None


def wait(state) -> None:
    """Collective: finish and publish a save in flight (before exiting or starting another)."""
    queue = state.extra.get("ckpt_queue")
    if queue is not None and queue.get_num_unfinalized_calls():
        queue.maybe_finalize_async_calls(blocking=True)
    state.extra["ckpt_pending"] = None


def resolve(state) -> Path | None:
    """The checkpoint to resume from: checkpoint.resume = auto | never | PATH. Only `latest` is
    trusted: unfinished saves and unpublished newer directories are reported and ignored."""
    how = state.cfg.checkpoint.resume
    if how == "never":
        return None
    if how != "auto":
        path = Path(how)
        if not path.is_dir():
            raise FtcoreError(f"no checkpoint directory at {path}", field="checkpoint.resume",
                              fix="a step_<N> directory, auto or never")  # fmt: skip
        return path
    root = ckpt_root(state)
    _check_own(state.run_dir, root)
    found = files.scan(root)
    published = found.published
    if _rank0(state):
        for d in found.incomplete:
            log.warning("ignoring incomplete checkpoint %s (a save that did not finish)", d)
        pub_step = _step_of(published)
        for s, d in found.complete:
            if published is None or s > pub_step:
                log.warning(
                    "ignoring unpublished checkpoint %s (checkpoints/latest does not name it)", d
                )
    if published is None:
        return None
    if not published.is_dir():
        raise FtcoreError(
            f"{root / 'latest'} points at {published.name}, which does not exist",
            field="checkpoint.resume",
            fix="point checkpoints/latest at a complete step_<N> directory, or checkpoint.resume=never",
        )
    _check_run_id(getattr(getattr(state.cfg, "run", None), "id", None), published)
    return published


def _check_run_id(run_id: str | None, step: Path) -> None:
    """checkpoint.resume=auto under a run id (a job script's run directory) loads only what that
    run wrote: the same job id on another cluster sharing the file system, or a directory left
    by an earlier job with a recycled id, is not this run. A checkpoint with no id (written
    without one, or by an earlier ftcore) says nothing and is taken."""
    if not run_id:
        return
    theirs = files.read_manifest(step).get("run_id")
    if theirs and theirs != run_id:
        raise FtcoreError(
            f"{step} was written by run {theirs}, not by this run ({run_id}): a run directory "
            "this run did not create is never resumed from automatically",
            field="checkpoint.resume",
            fix=f"checkpoint.resume={step} if it is yours to continue, or a new run.dir",
        )


def _check_own(run_dir: Path, root: Path) -> None:
    """checkpoint.resume=auto loads only from a run directory this user created: on a shared
    file system anyone who can write the output directory could pre-create the next job's
    `slurm-<id>/checkpoints/` (job ids are public). Another owner's is refused unless named."""
    latest = root / "latest"
    for p in (run_dir, root, latest):
        try:
            uid = os.lstat(p).st_uid
        except FileNotFoundError:
            continue
        if uid != os.getuid():
            raise FtcoreError(
                f"{p} belongs to user id {uid}, not to you (uid {os.getuid()}): a run directory you "
                "did not create is never resumed from automatically",
                field="checkpoint.resume",
                fix="run.dir=<a new directory>, or name the checkpoint if you trust it "
                f"(checkpoint.resume={root}/step_<N>), or checkpoint.resume=never",
            )
    if latest.is_file():
        step = safe_files.read_latest(root, "checkpoint.resume")
        if step is not None and step.exists() and os.lstat(step).st_uid != os.getuid():
            raise FtcoreError(
                f"{step} belongs to user id {os.lstat(step).st_uid}, not to you",
                field="checkpoint.resume",
                fix=f"checkpoint.resume={step} if you trust it, else checkpoint.resume=never",
            )
    # `checkpoints -> another run's checkpoints` passes lstat as yours, and `keep` would delete there
    safe_files.check_run_dir(run_dir, field="checkpoint.resume")


def _step_of(path: Path | None) -> int:
    try:
        return int(path.name.split("_")[-1]) if path is not None else -1
    except ValueError:
        return -1


def load(state, path: Path) -> list[str]:
    """Collective: check, load and restore `path` into the run; returns notes on what changed."""
    files.check_manifest(path, checksums=state.cfg.checkpoint.verify)
    # data, never code: a pickle naming anything else is refused before megatron reads it
    safe_files.read_metadata(path / ".metadata")
    common = safe_files.read_common(path)  # weights_only=True, whatever the environment says
    if not isinstance(common, dict) or not isinstance(common.get("ftcore"), dict):
        raise FtcoreError(
            f"{path} is not an ftcore checkpoint (no 'ftcore' state)",
            field="checkpoint.resume",
            fix="a step_<N> directory ftcore saved, or checkpoint.resume=never",
        )
    new_data = changes.check_compatible(state, common["ftcore"], path)
    optimizer_note = resume.optimizer_loadable(state.cfg, common["ftcore"])
    try:
        with cpu.device_mode(), safe_files.megatron_readers():
            optim = common["ftcore"]["optim_format"] if optimizer_note is None else None
            sd = resume.sharded_state_dict(state, is_loading=True, optim=optim)
            loaded = dist_checkpointing.load(sd, str(path))
    except FtcoreError:
        raise
    except (Exception, CheckpointException) as e:  # torch's is a BaseException
        refused = _refusal(e)
        if refused is not None:  # ftcore's own verdict inside torch's load (safe_files): as is
            raise refused from e
        raise FtcoreError(
            f"checkpoint {path} could not be loaded at this layout: {type(e).__name__}: {str(e)[:500]}",
            field="checkpoint.resume",
            fix="resume at the layout it was saved with (see its manifest.json), or checkpoint.resume=never",
        ) from e
    return resume.restore(state, loaded, path, optimizer_note, new_data=bool(new_data))


def _refusal(e: BaseException) -> FtcoreError | None:
    """The FtcoreError a rank raised inside torch's checkpoint load, which torch wraps in a
    CheckpointException of (exception, traceback) per rank."""
    for exc, _ in getattr(e, "failures", {}).values():
        if isinstance(exc, FtcoreError):
            return exc
    return None


def maybe_resume(state) -> None:
    """Resume from `checkpoint.resume` (auto: checkpoints/latest) if there is something to resume."""
    path = resolve(state)
    if path is None:
        return
    t0 = time.perf_counter()
    notes = load(state, path)
    if path.resolve() == (ckpt_root(state) / f"step_{state.step}").resolve():
        state.extra["ckpt_published"] = state.step  # nothing new to save at this step
    if _rank0(state):
        lay = resume.layout()
        log.info("resumed from %s at step %d (tp=%d pp=%d dp=%d, %.1f s)", path, state.step, lay["tp"],
                 lay["pp"], lay["dp"], time.perf_counter() - t0)  # fmt: skip
        for note in notes:
            log.warning(note)
