"""bench kind cpu_vs_hf: ftcore against the Hugging Face Trainer recipe, one epoch each.

A small random HF Llama is saved once; each round runs the HF recipe (ftcore.bench.hf_recipe) and each
ftcore configuration (ftcore.bench.worker with model.hf_path = that model) over the same documents,
one process each, same threads: back to back, or side by side taking turns (bench.turns,
ftcore.bench.turns). The lines hold non-padding tokens/s, the ratio to the HF run of the same round
and both eval losses.
"""

from __future__ import annotations

import logging

from omegaconf import OmegaConf

from ftcore.bench.runner import (
    FIXED,
    Bench,
    Run,
    expand_runs,
    launch,
    launch_taking_turns,
    layout_of,
    load_avg,
)
from ftcore.bench.worker import PARTS
from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")


def run_cpu_vs_hf(b: Bench) -> None:
    """`bench.repeats` rounds of the HF recipe then each ftcore run, so that on a machine whose
    speed drifts each ftcore run has an HF run of its own minutes to be compared with; with
    `bench.turns` a round's runs take turns in slices of their epochs instead (bench_turns)."""
    from ftcore.bench.hf_recipe import make_hf_model

    rounds, turns = max(1, int(b.bench.repeats)), int(b.bench.turns)
    runs = expand_runs(b.bench)
    # once per run: model.hf_path, threads and FIXED (added per round below) leave the layout as is
    layouts = [layout_of([*b.bench.base, *b.extra, *run.overrides]) for run in runs]
    if turns > 0:
        for run, layout in zip(runs, layouts):
            if layout["nproc_per_node"] > 1:
                raise FtcoreError(f"run {run.label!r} starts several processes; taking turns "
                                  "hands over between one process per run", field="bench.turns",
                                  fix="bench.turns=0, or launcher.nproc_per_node=1 in that run")  # fmt: skip
    hf = OmegaConf.to_container(b.bench.hf, resolve=True) if b.bench.hf else {}
    b.runs_dir.mkdir(parents=True, exist_ok=True)
    model_dir = make_hf_model(b.runs_dir / "hf_model", hf.get("shape"), int(hf.get("seed", 1234)))
    threads = int(b.bench.threads or 1)
    base = [*b.bench.base, *b.extra, f"model.hf_path={model_dir}"]
    for k in range(rounds):
        rdir = b.runs_dir / f"round{k + 1}" if rounds > 1 else b.runs_dir
        spec = {"model_dir": str(model_dir), "overrides": base, "batch_size": int(hf.get("batch_size", 16)),
                "threads": threads, "work_dir": str(rdir / "hf_trainer" / "trainer")}  # fmt: skip
        jobs = [("ftcore.bench.hf_recipe", [], spec, rdir / "hf_trainer", {})]
        for run in runs:
            ov = [*base, *run.overrides, *FIXED, f"launcher.threads_per_rank={threads}",
                  f"run.dir={rdir / run.label}"]  # fmt: skip
            jobs.append(("ftcore.bench.worker", ov, {"epoch": True, "eval": True}, rdir / run.label, run.env))  # fmt: skip
        if turns > 0:
            log.info("bench %s: round %d, %d runs taking turns in %d slices", b.bench.name, k + 1,
                     len(jobs), turns)  # fmt: skip
            load0 = load_avg()
            outcomes = launch_taking_turns(jobs, turns, b.timeout_s)
            loads = [[load0, load_avg()]] * len(jobs)
        else:
            outcomes, loads = [], []
            for job in jobs:
                log.info("bench %s: round %d, %s", b.bench.name, k + 1, job[3].name)
                load0 = load_avg()
                outcomes.append(launch(*job, b.timeout_s))
                loads.append([load0, load_avg()])
        res = _hf_line(b, outcomes[0], k + 1, loads[0], turns)
        for run, layout, outcome, load in zip(runs, layouts, outcomes[1:], loads[1:]):
            _ftcore_line(b, run, layout, outcome, res, k + 1, load, turns)


def _hf_line(b: Bench, outcome: tuple, round_: int, load: list, turns: int) -> dict | None:
    res, err = outcome
    line = {"label": "hf_trainer", "side": "hf", "round": round_, "load_avg": load, "turns": turns}
    if res is None:
        b.append({**line, "status": "failed", "error": err})
        return None
    res["tokens_per_s"] = res["tokens"] / res["wall_s"]
    res["tokens_per_cpu_s"] = res["tokens"] / res["cpu_s"] if res.get("cpu_s") else None
    b.append({**line, "status": "ok", **res})
    return res


def _ftcore_line(b: Bench, run: Run, layout: dict, outcome: tuple, res: dict | None, round_: int,
                 load: list, turns: int) -> None:  # fmt: skip
    r, err = outcome
    line = {"label": run.label, "side": "ftcore", "round": round_, "overrides": run.overrides,
            "env": run.env, "load_avg": load, "turns": turns}  # fmt: skip
    if r is None:
        b.append({**line, "status": "failed", "error": err})
        return
    tokens = sum(s["tokens"] for s in r["steps"])
    split = {p: sum(s["parts"].get(p, 0.0) for s in r["steps"]) for p in PARTS}
    split["other"] = max(0.0, r["wall_s"] - sum(split.values()))  # logging, metrics, timers
    line.update(
        status="ok", steps=len(r["steps"]), tokens=tokens,
        target_tokens=sum(s["target_tokens"] for s in r["steps"]), wall_s=r["wall_s"],
        tokens_per_s=tokens / r["wall_s"], eval_loss=r["eval_loss"], eval_tokens=r["eval_tokens"],
        train_loss_last=r["steps"][-1]["loss"], peak_mem_gib=r["peak_mem_gib"],
        threads=r.get("threads"), time_split_s=split, cpu_s=r.get("cpu_s"),
        tokens_per_cpu_s=tokens / r["cpu_s"] if r.get("cpu_s") else None, packing_efficiency=r["data_report"]["packing_efficiency"],
        layout=layout, waited_s=r.get("waited_s"),
    )  # fmt: skip
    if res is not None:
        line["ratio_vs_hf"] = line["tokens_per_s"] / res["tokens_per_s"]
        if line["tokens_per_cpu_s"] and res.get("tokens_per_cpu_s"):
            line["ratio_vs_hf_cpu"] = line["tokens_per_cpu_s"] / res["tokens_per_cpu_s"]
        line["eval_loss_rel_diff"] = (r["eval_loss"] - res["eval_loss"]) / res["eval_loss"]
        line["comparable"] = abs(line["eval_loss_rel_diff"]) <= 0.05
    b.append(line)
