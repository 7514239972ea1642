"""One benchmark configuration in its own process: `python -m ftcore.bench.worker [overrides]`.

ftcore.bench starts this once per configuration (a fresh process, so runs do not disturb each
other); with `launcher.nproc_per_node > 1` it starts its local workers the way ftcore.train does.
The steps are the trainer's own (`trainer.setup`, `trainer.train_step`), timed through the
training state's hook (`state.timers`, ftcore.training.timing): the loader, the forward-backward
schedule, the grad sync, the pipeline sends/receives (megatron's own timers) and the optimizer
split each step's wall time. Tensor-parallel collectives have no timing hook in megatron: their
time is part of fwd_bwd. What to run comes from the JSON file named by FTCORE_BENCH_SPEC:
  {"out": result file, "warmup": N, "measure": N}             fixed number of steps, or
  {"out": ..., "epoch": true, "eval": true, "warmup": W}      one epoch timed after step W, then
                                                              the validation loss.
Rank 0 writes the result JSON; nothing is checkpointed. The epoch run ends as a user's run does
(trainer.fit writes the HF adapter or model), after its timed span.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict

from omegaconf import DictConfig

from ftcore.bench.runner import read_spec, write_result
from ftcore.bench.steps import StepClock, check_warmup, digest, epoch_steps, record_groups
from ftcore.bench.turns import Turn
from ftcore.cli import run
from ftcore.training import timing

PARTS = ("data", "fwd_bwd", "grad_sync", "pp_p2p", "optimizer")


class Timers:
    """Seconds per timer name over the current step, with megatron's Timers interface
    (`timers(name, log_level=None).start()/.stop()`): it goes in `state.timers`, and the trainer
    hands it to megatron's schedule. Host time, no device sync (the step's own syncs bound it)."""

    def __init__(self):
        self.t = defaultdict(float)
        self._running: dict[str, float] = {}

    def __call__(self, name: str, log_level: int | None = None):
        return _Timer(self, name)

    def take(self) -> dict:
        """The step's split into PARTS, and a fresh start. Grad sync and pipeline sends run
        inside the schedule: fwd_bwd is the rest of it."""
        t = self.t
        p2p = sum(v for k, v in t.items() if timing.is_p2p(k))
        out = {
            "data": t[timing.DATA],
            "fwd_bwd": max(0.0, t[timing.FWD_BWD] - t[timing.GRAD_SYNC] - p2p),
            "grad_sync": t[timing.GRAD_SYNC],
            "pp_p2p": p2p,
            "optimizer": t[timing.OPTIMIZER],
        }
        t.clear()
        return out


class _Timer:
    def __init__(self, timers: Timers, name: str):
        self.timers, self.name = timers, name

    def start(self, barrier: bool = False) -> None:
        self.timers._running[self.name] = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        t0 = self.timers._running.pop(self.name)
        self.timers.t[self.name] += time.perf_counter() - t0


def _gather(obj):
    import torch.distributed as dist

    from ftcore.runtime import collectives

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    collectives.all_gather_object(out, obj)
    return out


def measure(state, spec: dict) -> dict:
    from ftcore.training import evaluation, metrics

    cfg = state.cfg
    state.timers = timers = Timers()
    loader = state.loader
    if spec.get("epoch"):
        records, wall = _epoch(state, timers, int(spec.get("warmup", 0)))
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
    result["span"] = state.extra.get("bench_span")  # epoch: the timed span (bench.steps)
    if spec.get("eval"):
        # every validation batch, not only eval.iters of them
        res = evaluation.evaluate(state, evaluation.held_out_batches(state))
        result["eval_loss"], result["eval_tokens"] = res.loss, res.tokens
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


def _epoch(state, timers: Timers, warmup: int) -> tuple[list[dict], float]:
    """One epoch through trainer.fit, as users run it (metrics.jsonl, log lines), timed from the
    end of optimizer step `warmup` to the end of the last one through state.after_step hooks
    (ftcore.bench.steps), less the turns waited for; the split is the epoch's total, put on the
    last step. The documents of every step are recorded (their digest is compared with HF's)."""
    from ftcore.training import trainer

    cfg = state.cfg
    steps = epoch_steps(state.loader.report["rows"], cfg.train.global_batch_size)
    check_warmup(steps, warmup)
    cfg.train.max_steps = steps
    groups = record_groups(state.loader)
    turn = Turn.from_env()
    clock = StepClock(turn)
    # the clock first, before a hand-over; the end-of-run export comes after the last step
    state.after_step.insert(0, clock.mark)
    if turn is not None:  # hand over to the round's other runs every few steps (bench.turns)
        turn.start(steps)
        state.after_step.append(lambda _: turn.after_step())
    clock.mark()
    trainer.fit(state)
    span = clock.span(warmup)
    records = []
    if state.info.rank == 0:
        for line in (state.run_dir / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if "loss" in r:
                records.append({"step": r["step"], "warmup": r["step"] <= warmup,
                                "loss": r["loss"], "tokens": r["tokens"],
                                "target_tokens": r["target_tokens"],
                                "step_time_s": r["step_time_s"], "parts": {}})  # fmt: skip
        if records:
            records[-1]["parts"] = timers.take()
    state.extra["bench_cpu_s"] = span["cpu_s"]
    state.extra["bench_waited_s"] = span["waited_s"]
    state.extra["bench_span"] = {**span, "warmup_steps": warmup,
                                 "groups_digest": digest(groups[:steps])}  # fmt: skip
    return records, span["wall_s"]


def _flops_per_token(cfg) -> float:
    from ftcore.planner.flops import model_flops_per_token

    return float(model_flops_per_token(cfg))


def task(cfg: DictConfig) -> int | None:
    from ftcore.runtime import dist
    from ftcore.training import trainer
    from ftcore.validation import checks

    spec = read_spec()
    if not dist.under_launcher() and cfg.launcher.nproc_per_node > 1:
        checks.validate(cfg, cfg.launcher.nproc_per_node)
        return dist.launch_local_workers(
            "ftcore.bench.worker", sys.argv[1:], cfg.launcher.nproc_per_node, cfg
        )
    try:
        state = trainer.setup(cfg)
        result = measure(state, spec)
        if state.info.rank == 0:
            write_result(spec, result)
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
