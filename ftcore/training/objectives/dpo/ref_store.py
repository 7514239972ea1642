"""objective.precompute_ref: DPO's reference log-probs from one pass over the data before training
(docs/preference.md), instead of a frozen copy's forward at every step.

The pass runs the starting model (LoRA: its adapters off, or the reference adapter swapped in)
over every pair the training stream can draw and over the held-out pairs, through the same
schedule and layout as training, before a checkpoint is restored: so what it sees is always the
starting weights, in a fresh run and in a resumed one. Each pair's (chosen, rejected) sequence
log-prob is stored under its sample id (its position in the data's pair table, what
MicroBatch.pair_ids holds), which does not depend on the layout, the DP size or the stream
position. The tables are kept in run.dir/reference_logps.pt (written atomically by rank 0 once
setup has succeeded): a
resumed or re-sharded run on the same data and model reads them instead of running the pass
again. The file is data: read with weights_only=True, and used only when its fingerprint (the
pairs' token ids, the model and reference settings) is this run's; otherwise the pass runs again.
"""

from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from omegaconf import OmegaConf

from ftcore.data.pipeline import assemble
from ftcore.errors import FtcoreError
from ftcore.runtime import collectives, safe_files
from ftcore.runtime import dist as rdist
from ftcore.training.objectives.dpo.step import reference_step
from ftcore.training.step import is_loss_rank, schedule

log = logging.getLogger("ftcore")
FILE = "reference_logps.pt"
PENDING = "reference_logps_unsaved"  # state.extra key of a pass not yet written
VERSION = 1


def fingerprint(cfg, docs, ids: np.ndarray) -> str:
    """What the stored values depend on: the pairs' tokens and targets, the model, the reference."""
    h = hashlib.sha256()
    for key in ("model", "peft", "precision"):
        h.update(OmegaConf.to_yaml(cfg[key], resolve=True).encode())
    h.update(str(cfg.objective.ref_adapter_path).encode())
    h.update(OmegaConf.to_yaml(cfg.eval, resolve=True).encode())  # the held-out pairs
    h.update(OmegaConf.to_yaml(cfg.data, resolve=True).encode())
    for u in ids.tolist():
        for k in range(docs.group):
            d = docs.docs[docs.group * u + k]
            h.update(np.ascontiguousarray(d.ids, np.int64).tobytes())
            h.update(np.ascontiguousarray(d.targets, np.int8).tobytes())
    return h.hexdigest()


def _pass(state, ref, batches, table: torch.Tensor) -> None:
    """The reference's forward over `batches` (global batches: this rank's micro-batches); the
    loss ranks of CP rank 0 write each pair's sums into `table` at its sample id."""
    owner = is_loss_rank() and ps.get_context_parallel_rank() == 0
    for microbatches in batches:
        store: dict = {}
        with torch.no_grad(), ref.context():
            step = reference_step(state.cfg, store)
            schedule(state, microbatches, forward_only=True, step=step, model=ref.chunks)
        if owner:
            for mb in microbatches:
                if mb.num_pairs:
                    table[list(mb.pair_ids)] = store[id(mb)].detach().double().cpu()


def _train_batches(state, ids: np.ndarray):
    """Every pair of the stream once, one pair per row, in global batches as training takes them
    (the last filled with empty rows, so every rank runs as many micro-batches)."""
    cfg, loader = state.cfg, state.loader
    g, per = cfg.train.global_batch_size, cfg.train.global_batch_size // state.dp
    rank = ps.get_data_parallel_rank()
    rows = [[int(u)] for u in ids]
    rows += [[] for _ in range(-len(rows) % g)]
    for k in range(0, len(rows), g):
        mine = rows[k + rank * per : k + (rank + 1) * per]
        yield assemble(cfg, loader.docs, mine, loader.pad_id)


def _compute(state, ref, ids: np.ndarray, val_size: int) -> dict[str, torch.Tensor]:
    train = torch.zeros(state.loader.docs.samples, 2, dtype=torch.float64)
    val = torch.zeros(val_size, 2, dtype=torch.float64)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # the pass draws nothing training would see
        _pass(state, ref, _train_batches(state, ids), train)
        _pass(state, ref, state.val_batches, val)
    for t in (train, val):  # each pair has exactly one owner, the others add 0.0: exact
        t.copy_(_world_sum(t))
    return {"train": train.float(), "val": val.float()}


def _world_sum(t: torch.Tensor) -> torch.Tensor:
    """A host table summed over the world, back on the host: the tables are filled and read on
    the host, but the default group is NCCL on a GPU cluster, which takes device tensors only."""
    d = t.to(rdist.comm_device())
    collectives.all_reduce(d)
    return d.cpu()


def _load(path: Path, key: str) -> dict | None:
    if not path.is_file():
        return None
    try:
        got = safe_files.torch_load(path, "objective.precompute_ref", root=path.parent)
    except FtcoreError as e:  # a damaged file is recomputed, not trusted
        log.warning("precompute_ref: %s is unreadable (%s): computing it again", path, e)
        return None
    if not isinstance(got, dict) or got.get("version") != VERSION or got.get("key") != key:
        log.warning("precompute_ref: %s is for other pairs or another model: computing again", path)
        return None
    return got


def _agreed(ok: bool) -> bool:
    """True only when every rank found the file usable."""
    flag = torch.tensor([1 if ok else 0], device=rdist.comm_device())
    collectives.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def attach(state) -> None:
    """Load or compute the stored reference log-probs into state.extra["reference"] (before resume:
    the model holds its starting weights)."""
    ref, cfg = state.extra["reference"], state.cfg
    docs = state.loader.docs
    ids = np.unique(np.concatenate(docs.source_ids)) if docs.source_ids else np.zeros(0, np.int64)
    val_ids = [u for batch in state.val_batches for mb in batch for u in (mb.pair_ids or ())]
    val_size = _max_over_ranks(val_ids)
    key = fingerprint(cfg, docs, ids)
    path = Path(state.run_dir, FILE)
    got = _load(path, key)
    ok = (
        got is not None
        and got["train"].shape == (docs.samples, 2)
        and got["val"].shape == (val_size, 2)
    )
    if _agreed(ok):
        log.info("precompute_ref: reference log-probs of %d pairs read from %s", len(ids), path)
        tables = {"train": got["train"], "val": got["val"]}
    else:
        log.info("precompute_ref: one forward pass over %d pairs for the reference", len(ids))
        tables = _compute(state, ref, ids, val_size)
        state.extra[PENDING] = {"version": VERSION, "key": key, **tables}  # save(), once resumed
    ref.tables = tables
    ref.val_batches = {id(mb) for batch in state.val_batches for mb in batch}


def save(state) -> None:
    """Write a pass computed by attach() to run.dir (rank 0, atomically), once setup has passed
    its last refusal (resume): a run that fails to start writes nothing."""
    payload = state.extra.pop(PENDING, None)
    if payload is None:
        return
    if dist.get_rank() == 0:
        path = Path(state.run_dir, FILE)
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save(payload, buf)
        safe_files.write_atomic(path, buf.getvalue())  # .reference_logps.pt.tmp: never a link
    collectives.barrier()


def _max_over_ranks(val_ids: list[int]) -> int:
    """The held-out table's size: one more than the largest held-out sample id of any rank."""
    n = torch.tensor([max(val_ids) + 1 if val_ids else 0], device=rdist.comm_device())
    collectives.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item())
