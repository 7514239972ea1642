"""bench kind `host_overhead`: the host time a training step spends per layer and micro-batch.

The same tiny HF Llama (width 64, so the arithmetic is negligible) at two depths, trained by ftcore
(ftcore.bench.worker, one packed row) and by PEFT on transformers (ftcore.bench.hf_steps, one row
of the same length), one thread, in fresh processes. The difference in CPU time per step between
the depths, divided by the difference in layers, is the host overhead per layer and micro-batch:
Python, autograd and kernel launches, which a GPU pays too while its kernels are short (small
micro-batches, small TP shards) and which this CPU pays at every width. Rounds interleave the
sides, so drift in the VM's speed falls on both.
"""

from __future__ import annotations

import logging
import statistics

from omegaconf import OmegaConf

from ftcore.bench.runner import FIXED, Bench, launch, load_avg

log = logging.getLogger("ftcore")


def run_host_overhead(b: Bench) -> None:
    from ftcore.bench.hf_recipe import make_hf_model
    from ftcore.config.schema import compose

    bench = b.bench
    o = OmegaConf.to_container(bench.overhead, resolve=True)
    shape, depths = o.get("shape") or {}, [int(d) for d in o["depths"]]
    threads, rows, seq = int(bench.threads or 1), int(o["rows"]), int(o["seq_len"])
    warm, meas = int(bench.warmup_steps), int(bench.measure_steps)
    b.runs_dir.mkdir(parents=True, exist_ok=True)
    models = {d: make_hf_model(b.runs_dir / f"hf_model_{d}L", {**shape, "num_hidden_layers": d})
              for d in depths}  # fmt: skip
    base = [*bench.base, *b.extra, f"data.seq_len={seq}", f"train.global_batch_size={rows}",
            f"train.micro_batch_size={rows}", f"launcher.threads_per_rank={threads}"]  # fmt: skip
    peft = compose(list(base)).peft
    lora = {"r": int(peft.r), "alpha": float(peft.lora_alpha), "targets": list(peft.target_modules)}
    for k in range(max(1, int(bench.repeats))):
        for d in depths:
            rdir = b.runs_dir / f"round{k + 1}"
            ov = [*base, f"model.hf_path={models[d]}", *FIXED, f"train.max_steps={warm + meas}",
                  f"run.dir={rdir / f'ftcore-{d}L'}"]  # fmt: skip
            hf_spec = {"model_dir": str(models[d]), "rows": rows, "seq_len": seq, "warmup": warm,
                       "measure": meas, "threads": threads, "lora": lora}  # fmt: skip
            jobs = [("hf", "ftcore.bench.hf_steps", [], hf_spec),
                    ("ftcore", "ftcore.bench.worker", ov, {"warmup": warm, "measure": meas})]  # fmt: skip
            for side, module, overrides, spec in jobs:
                log.info("bench %s: round %d, %s at %d layers", bench.name, k + 1, side, d)
                load0 = load_avg()
                res, err = launch(module, overrides, spec, rdir / f"{side}-{d}L", {}, b.timeout_s)
                line = {"label": f"{side}-{d}L", "side": side, "layers": d, "round": k + 1,
                        "rows": rows, "seq_len": seq, "threads": threads,
                        "load_avg": [load0, load_avg()]}  # fmt: skip
                if res is None:
                    b.append({**line, "status": "failed", "error": err})
                    continue
                steps = [s for s in res["steps"] if not s["warmup"]]
                b.append({**line, "status": "ok", "steps_measured": len(steps),
                          "cpu_ms": 1e3 * statistics.median(s["cpu_s"] for s in steps),
                          "wall_ms": 1e3 * statistics.median(s["step_time_s"] for s in steps)})  # fmt: skip


def per_layer(lines: list[dict]) -> dict[str, dict]:
    """Per side: median over rounds of the per-layer slope and the per-step intercept (CPU ms)."""
    out = {}
    for side in ("ftcore", "hf"):
        slopes, rest = [], []
        for r in sorted({ln["round"] for ln in lines}):
            pts = {ln["layers"]: ln["cpu_ms"] for ln in lines if ln.get("status") == "ok"
                   and ln["side"] == side and ln["round"] == r}  # fmt: skip
            if len(pts) < 2:
                continue
            lo, hi = min(pts), max(pts)
            slope = (pts[hi] - pts[lo]) / (hi - lo)
            slopes.append(slope)
            rest.append(pts[lo] - lo * slope)
        if slopes:
            out[side] = {"per_layer_ms": statistics.median(slopes), "rest_ms": statistics.median(rest),
                         "rounds": len(slopes), "range": [min(slopes), max(slopes)]}  # fmt: skip
    return out


def overhead_md(lines: list[dict]) -> list[str]:
    ok = [ln for ln in lines if ln.get("status") == "ok"]
    fit = per_layer(ok)
    first = ok[0] if ok else lines[0]
    out = [
        f"Micro-batch: {first.get('rows')} row(s) of {first.get('seq_len')} tokens, "
        f"{first.get('threads')} thread(s); CPU ms per step = median over the measured steps.",
        "",
        "| side | host CPU ms per layer and micro-batch (median over rounds) | range | rest of the step, ms | rounds |",
        "|---|---:|---|---:|---:|",
    ]  # fmt: skip
    for side, f in fit.items():
        out.append(f"| {side} | {f['per_layer_ms']:.3f} | {f['range'][0]:.3f}–{f['range'][1]:.3f} "
                   f"| {f['rest_ms']:.1f} | {f['rounds']} |")  # fmt: skip
    out += [
        "",
        "| round | run | layers | CPU ms/step | wall ms/step |",
        "|---:|---|---:|---:|---:|",
    ]
    for ln in lines:
        if ln.get("status") != "ok":
            out.append(f"| {ln.get('round')} | {ln['label']} | {ln.get('layers')} | failed | {ln.get('error', '')[:80]} |")  # fmt: skip
            continue
        out.append(f"| {ln['round']} | {ln['label']} | {ln['layers']} | {ln['cpu_ms']:.2f} | {ln['wall_ms']:.2f} |")  # fmt: skip
    return out
