"""bench kind `layouts`: each configuration trains a few steps in its own process
(ftcore.bench.worker); its line holds the layout, tokens/s, step time (median, spread), the model
TFLOP/s and the planner's prediction for the same configuration."""

from __future__ import annotations

import logging
import statistics

from ftcore.bench.runner import Bench, expand_runs, launch, layout_of, load_avg
from ftcore.bench.worker import PARTS, median_spread
from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")


def predict(overrides: list[str]) -> dict | None:
    """The planner's prediction for a configuration (its local_cpu calibration on CPU)."""
    from ftcore import planner
    from ftcore.config.schema import compose

    try:
        cfg = compose(overrides)
        if cfg.model.hf_path:
            from ftcore.hf.config import merge_hf_config

            cfg = merge_hf_config(cfg)
        world = cfg.cluster.num_gpus or cfg.launcher.nproc_per_node
        p = planner.plan(cfg, world)
    except Exception as e:  # noqa: BLE001 - a prediction that fails leaves the run standing
        log.warning("bench: no prediction for %s: %s", overrides, e)
        return None
    return {
        "tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"],
        "step_time_s": p["step_time_s"],
        "model_tflops_per_gpu": p["model_tflops_per_gpu"],
        "mfu": p["mfu"],
        "memory_gib": p["memory_gib"]["total"],
        "fits": p["fits"],
        "step_time_parts_s": p["step_time_parts_s"],
    }


def summarize(result: dict, layout: dict) -> dict:
    """The measured part of a line: steps after warm-up only."""
    steps = [s for s in result["steps"] if not s["warmup"]]
    world = result["world"]
    times = [s["step_time_s"] for s in steps]
    med, spread = median_spread(times)
    total_t = sum(times) or float("nan")
    tokens = sum(s["tokens"] for s in steps)
    targets = sum(s["target_tokens"] for s in steps)
    slot = layout["global_batch_size"] * layout["seq_len"]
    tps = tokens / total_t
    tflops = result["flops_per_token"] * tps / world / 1e12
    split = {}
    for part in PARTS:
        per_rank = [statistics.fmean(p[part] for p, s in zip(rank, result["steps"]) if not s["warmup"])
                    for rank in result["parts_by_rank"]] if steps else [0.0]  # fmt: skip
        split[part] = statistics.fmean(per_rank)
    split["other"] = max(0.0, (total_t / max(len(steps), 1)) - sum(split.values()))
    peak = layout.get("peak_bf16_tflops")
    measured = [i for i, s in enumerate(result["steps"]) if not s["warmup"]]
    cpu_rows = [r for r in result.get("cpu_by_rank", []) if r and None not in r]
    cpu = [max(r[i] for r in cpu_rows) for i in measured] if cpu_rows else []
    return {
        "cpu_step_s": statistics.median(cpu) if cpu else None,
        "steps_measured": len(steps),
        "step_time_s": med,
        "step_time_spread": spread,
        "step_time_min_s": min(times) if times else None,
        "step_time_max_s": max(times) if times else None,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / world,
        "target_tokens_per_s": targets / total_t,
        "slot_tokens_per_s_per_gpu": slot / med / world,
        "model_tflops_per_gpu": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_mem_gib": result["peak_mem_gib"],
        "time_split_s": split,
        "losses": [s["loss"] for s in result["steps"]],
        "threads": result.get("threads"),
    }


def run_layouts(b: Bench) -> None:
    from ftcore.planner import host

    warm, meas = int(b.bench.warmup_steps), int(b.bench.measure_steps)
    for run in expand_runs(b.bench):
        ov = b.overrides(run) + [f"train.max_steps={warm + meas}"]
        rdir = b.runs_dir / run.label
        ov.append(f"run.dir={rdir}")
        line = {"label": run.label, "overrides": run.overrides, "env": run.env}
        if run.held_out is not None:  # the planner's local_cpu constants fitted to it, or not
            line["held_out"] = run.held_out
        try:
            layout = layout_of(ov)
        except FtcoreError as e:
            b.append({**line, "status": "failed", "error": str(e)})
            continue
        host.probe.cache_clear()  # a VM's speed drifts by 20-40% over minutes: rates of now
        predicted = predict(ov)  # (measured again where the cluster asks: cluster.host_probe)
        rates = host.probe() if host.probe.cache_info().currsize else None
        load0 = load_avg()
        log.info("bench %s: running %s", b.bench.name, run.label)
        result, err = launch("ftcore.bench.worker", ov, {"warmup": warm, "measure": meas},
                             rdir, run.env, b.timeout_s)  # fmt: skip
        line.update(layout=layout, predicted=predicted, load_avg=[load0, load_avg()])
        if rates:
            line["host_probe"] = rates
        if result is None:
            b.append({**line, "status": "failed", "error": err})
            continue
        m = summarize(result, layout)
        if predicted:
            m["measured_over_predicted"] = predicted["step_time_s"] / m["step_time_s"]
            if m["cpu_step_s"]:
                m["measured_over_predicted_cpu"] = predicted["step_time_s"] / m["cpu_step_s"]
        b.append({**line, "status": "ok", **m})
