"""One benchmark configuration in its own process: `python -m ftcore.bench.worker [overrides]`.

ftcore.bench starts this once per configuration (a fresh process, so runs do not disturb each
other); with `launcher.nproc_per_node > 1` it starts its local workers the way ftcore.train does.
The steps are the trainer's own (`trainer.setup`, `trainer.train_step`); timers wrapped around the
loader, the pipeline schedule, the grad sync, TP collectives, pipeline sends and the optimizer
split each step's wall time. What to run comes from the JSON file named by FTCORE_BENCH_SPEC:
  {"out": result file, "warmup": N, "measure": N}             fixed number of steps, or
  {"out": ..., "epoch": true, "eval": true}                   one epoch, then the validation loss.
Rank 0 writes the result JSON; nothing is checkpointed or exported.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from omegaconf import DictConfig

from ftcore.bench.turns import Turn
from ftcore.cli import run

SPEC_ENV = "FTCORE_BENCH_SPEC"
PARTS = ("data", "fwd_bwd", "tp_comm", "grad_sync", "pp_p2p", "optimizer")


class Timers:
    """Seconds per named part of the current step; nested parts are subtracted from fwd_bwd later."""

    def __init__(self):
        self.t = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[name] += time.perf_counter() - t0

        timed.__wrapped__ = fn
        return timed

    def take(self) -> dict:
        out = {k: self.t.get(k, 0.0) for k in PARTS}
        # grad sync, TP collectives and pipeline sends run inside the schedule: fwd_bwd is the rest
        out["fwd_bwd"] = max(
            0.0, out["fwd_bwd"] - out["tp_comm"] - out["grad_sync"] - out["pp_p2p"]
        )
        self.t.clear()
        return out


def instrument(state, timers: Timers) -> None:
    """Wrap the pieces of trainer.train_step (this process only: it exists to be measured)."""
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.tensor_parallel import mappings

    from ftcore.training import trainer

    trainer.run_batches = timers.wrap("fwd_bwd", trainer.run_batches)
    state.loader.next_microbatches = timers.wrap("data", state.loader.next_microbatches)
    state.optimizer.prepare_grads = timers.wrap("optimizer", state.optimizer.prepare_grads)
    trainer.optim.grad_norm = timers.wrap("optimizer", trainer.optim.grad_norm)
    trainer.optim.step_with_norm = timers.wrap("optimizer", trainer.optim.step_with_norm)
    config = state.model[0].config
    config.finalize_model_grads_func = timers.wrap("grad_sync", config.finalize_model_grads_func)
    comm = p2p_communication.P2PCommunicator
    comm._communicate = timers.wrap("pp_p2p", comm._communicate)
    for name in (
        "_reduce",
        "_gather_along_last_dim",
        "_gather_along_first_dim",
        "_reduce_scatter_along_first_dim",
        "_reduce_scatter_along_last_dim",
    ):
        if hasattr(mappings, name):
            setattr(mappings, name, timers.wrap("tp_comm", getattr(mappings, name)))


def _gather(obj):
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def eval_loss(state) -> tuple[float, int]:
    """Per-token validation loss over every validation batch (not only eval.iters of them)."""
    from megatron.core import parallel_state as ps

    from ftcore.data.pipeline import build_val_batches
    from ftcore.training import trainer

    cfg = state.cfg
    batches = build_val_batches(cfg, state.tokenizer, ps.get_data_parallel_rank(), state.dp)
    import torch

    for chunk in state.model:
        chunk.eval()
    total, n = 0.0, 0.0
    with torch.no_grad():
        for mbs in batches:
            s, c = trainer.run_batches(state, mbs, forward_only=True)
            total, n = total + s, n + c
    return total / max(n, 1.0), int(n)


def measure(state, spec: dict) -> dict:
    from ftcore.training import metrics

    cfg = state.cfg
    timers = Timers()
    instrument(state, timers)
    loader = state.loader
    if spec.get("epoch"):
        records, wall = _epoch(state, timers)
    else:
        records, wall = _steps(state, timers, int(spec["warmup"]), int(spec["measure"]))
    result = {"steps": records, "wall_s": wall}
    # every rank's split (pipeline stages differ); rank 0 keeps them all
    all_parts = _gather([r["parts"] for r in records])
    result["parts_by_rank"] = all_parts
    result["cpu_by_rank"] = _gather([r.get("cpu_s") for r in records])
    result["cpu_s"] = state.extra.get("bench_cpu_s")
    result["waited_s"] = state.extra.get("bench_waited_s")  # outside the steps' times already
    result["peak_mem_gib"] = max(_gather(metrics.peak_mem_gib()))
    if spec.get("eval"):
        result["eval_loss"], result["eval_tokens"] = eval_loss(state)
    result["data_report"] = loader.report
    result["world"] = state.info.world
    result["dp"] = state.dp
    result["flops_per_token"] = _flops_per_token(cfg)
    result["threads"] = __import__("torch").get_num_threads()
    return result


def _steps(state, timers: Timers, warmup: int, measure: int) -> tuple[list[dict], float]:
    """warmup + measure calls of trainer.train_step, each timed and split."""
    from ftcore.training import trainer

    records = []
    t_start = time.perf_counter()
    for i in range(warmup + measure):
        t0, c0 = time.perf_counter(), time.process_time()
        out = trainer.train_step(state)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        state.step += 1
        records.append(
            {
                "step": i + 1,
                "warmup": i < warmup,
                "loss": out["loss"],
                "skipped": bool(out.get("skipped")),
                "tokens": out.get("tokens", 0),
                "target_tokens": out.get("target_tokens", 0),
                "step_time_s": dt,
                "cpu_s": cpu,  # this process's CPU seconds (all threads): less sensitive to load
                "parts": timers.take(),
            }
        )
    return records, time.perf_counter() - t_start


def _epoch(state, timers: Timers) -> tuple[list[dict], float]:
    """One epoch through trainer.fit, as users run it (metrics.jsonl, log lines); the steps'
    times are metrics.jsonl's step_time_s, the split is the epoch's total, put on the last step."""
    from ftcore.training import trainer

    cfg = state.cfg
    steps = math.ceil(state.loader.report["rows"] / cfg.train.global_batch_size)
    cfg.train.max_steps = steps
    turn = Turn.from_env()
    if turn is not None:  # hand over to the round's other runs every few steps (bench.turns)
        turn.start(steps)
        state.after_step.append(lambda _: turn.after_step())
    cpu = [time.process_time()] * 2  # at the start, at the end of the latest step

    def mark(_):
        cpu[1] = time.process_time()

    state.after_step.insert(0, mark)  # before a hand-over; the end-of-run export comes after
    trainer.fit(state)
    state.extra["bench_cpu_s"] = cpu[1] - cpu[0]
    records = []
    if state.info.rank == 0:
        for line in (state.run_dir / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if "loss" in r:
                records.append({"step": r["step"], "warmup": False, "loss": r["loss"],
                                "tokens": r["tokens"], "target_tokens": r["target_tokens"],
                                "step_time_s": r["step_time_s"], "parts": {}})  # fmt: skip
        if records:
            records[-1]["parts"] = timers.take()
    state.extra["bench_waited_s"] = turn.waited_s if turn is not None else 0.0
    return records, sum(r["step_time_s"] for r in records)


def _flops_per_token(cfg) -> float:
    from ftcore.planner.flops import model_flops_per_token

    return float(model_flops_per_token(cfg))


def task(cfg: DictConfig) -> int | None:
    from ftcore.config import checks
    from ftcore.runtime import dist
    from ftcore.training import trainer

    spec = json.loads(Path(os.environ[SPEC_ENV]).read_text())
    if not dist.under_launcher() and cfg.launcher.nproc_per_node > 1:
        checks.validate(cfg, cfg.launcher.nproc_per_node)
        return dist.launch_local_workers(
            "ftcore.bench.worker", sys.argv[1:], cfg.launcher.nproc_per_node
        )
    try:
        state = trainer.setup(cfg)
        result = measure(state, spec)
        if state.info.rank == 0:
            tmp = Path(spec["out"]).with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, spec["out"])
    finally:
        dist.teardown()
    return None


def median_spread(xs: list[float]) -> tuple[float, float]:
    """(median, (max - min) / median) of the measured step times."""
    if not xs:
        return float("nan"), float("nan")
    med = statistics.median(xs)
    return med, (max(xs) - min(xs)) / med if med else float("nan")


if __name__ == "__main__":
    run("bench_worker", task)
