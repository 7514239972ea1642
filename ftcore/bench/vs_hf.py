"""bench kind cpu_vs_hf: ftcore against the Hugging Face Trainer recipe at its best, pair by pair.

For every model of `bench.models` a random HF Llama is saved once; ftcore loads it through
model.hf_path. Each round, per model, runs every pair (ftcore.bench.pairs: an ftcore run and its
HF recipe, over the same documents in the same optimizer steps, ftcore.bench.steps), one process
per side with the same
threads: back to back, or side by side taking turns (bench.turns, ftcore.bench.turns). Each side
is timed from the end of optimizer step bench.warmup_steps to the end of its last step. The host's
fp32 GEMM rate (ftcore.bench.gemm) is measured just before and after each model's runs. A line per
side: measured and epoch tokens, wall and CPU seconds, losses, model FLOP/s and its share of the
GEMM rate; the ftcore line carries the pair's ratios and whether it is comparable.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from ftcore.bench import gemm
from ftcore.bench.pairs import Model, Pair, compare, models_of, pairs_of
from ftcore.bench.runner import FIXED, Bench, launch, launch_taking_turns, layout_of, load_avg
from ftcore.bench.worker import PARTS
from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")


def run_cpu_vs_hf(b: Bench) -> None:
    """`bench.repeats` rounds; in each, every pair on every model, between two GEMM rates."""
    from ftcore.bench.hf_recipe import make_hf_model

    pairs, models = pairs_of(b.bench), models_of(b.bench)
    rounds, turns = max(1, int(b.bench.repeats)), int(b.bench.turns)
    layouts = {p.run.label: layout_of([*b.bench.base, *b.extra, *p.run.overrides]) for p in pairs}
    if turns > 0:
        for label, layout in layouts.items():
            if layout["nproc_per_node"] > 1:
                raise FtcoreError(f"run {label!r} starts several processes; taking turns "
                                  "hands over between one process per run", field="bench.turns",
                                  fix="bench.turns=0, or launcher.nproc_per_node=1 in that run")  # fmt: skip
    hf = OmegaConf.to_container(b.bench.hf, resolve=True) if b.bench.hf else {}
    b.runs_dir.mkdir(parents=True, exist_ok=True)
    dirs = {m.label: make_hf_model(b.runs_dir / f"hf_model_{m.label}",
                                   {**(hf.get("shape") or {}), **m.shape}, int(hf.get("seed", 1234)))
            for m in models}  # fmt: skip
    flops = {(m.label, p.run.label): flops_per_token(_overrides(b, dirs[m.label], p))
             for m in models for p in pairs}  # fmt: skip
    threads = int(b.bench.threads or 1)
    for k in range(rounds):
        for m in models:
            rdir = b.runs_dir / (f"round{k + 1}" if rounds > 1 else "") / m.label
            jobs = plan(b, m, pairs, dirs[m.label], rdir, threads)
            before = gemm.measure(threads, int(b.bench.gemm_size))
            outcomes, loads = _launch(b, jobs, turns, f"round {k + 1}, {m.label}")
            rate = _best(before, gemm.measure(threads, int(b.bench.gemm_size)))
            log.info("bench %s: round %d, %s: fp32 GEMM %s GFLOP/s on %d threads", b.bench.name,
                     k + 1, m.label, f"{rate['flops_per_s'] / 1e9:.0f}" if rate["flops_per_s"]
                     else "?", threads)  # fmt: skip
            for i, p in enumerate(pairs):
                ctx = {"round": k + 1, "model": m.label, "pair": p.run.label, "turns": turns,
                       "gemm": rate, "flops_per_token": flops[(m.label, p.run.label)],
                       "loss_tolerance": float(b.bench.loss_tolerance)}  # fmt: skip
                hf_line = side_line(
                    "hf", f"hf-{p.hf}", outcomes[2 * i], {**ctx, "load_avg": loads[2 * i]}
                )
                ft_ctx = {**ctx, "load_avg": loads[2 * i + 1], "overrides": p.run.overrides,
                          "env": p.run.env, "layout": layouts[p.run.label]}  # fmt: skip
                ft_line = side_line("ftcore", f"ftcore-{p.run.label}", outcomes[2 * i + 1], ft_ctx)
                ft_line.update(compare(hf_line, ft_line, float(b.bench.loss_tolerance)))
                b.append(hf_line)
                b.append(ft_line)


def _best(before: dict, after: dict) -> dict:
    """The GEMM rate measured just before and just after a model's runs: the faster one is the
    host's limit over that stretch (a VM's speed drifts; a slow moment would flatter the runs)."""
    rates = [r["flops_per_s"] for r in (before, after) if r["flops_per_s"]]
    return {**before, "flops_per_s": max(rates) if rates else None,
            "measured": [before["flops_per_s"], after["flops_per_s"]]}  # fmt: skip


def _overrides(b: Bench, model_dir: Path, p: Pair) -> list[str]:
    """What both sides of a pair are configured from: the ftcore run's overrides on this model."""
    return [*b.bench.base, *b.extra, f"model.hf_path={model_dir}", *p.run.overrides]


def plan(b: Bench, m: Model, pairs: list[Pair], model_dir: Path, rdir: Path, threads: int) -> list:
    """The jobs of one model in one round: per pair, the HF recipe then the ftcore run."""
    warmup = int(b.bench.warmup_steps)
    jobs = []
    for p in pairs:
        ov, pdir = _overrides(b, model_dir, p), rdir / p.run.label
        spec = {"model_dir": str(model_dir), "overrides": ov, "collator": p.hf, "warmup": warmup,
                "optim": (b.bench.hf or {}).get("optim", "adamw_torch_fused"), "threads": threads,
                "work_dir": str(pdir / "hf" / "trainer")}  # fmt: skip
        jobs.append(("ftcore.bench.hf_recipe", [], spec, pdir / "hf", {}))
        ft = [*ov, *FIXED, f"launcher.threads_per_rank={threads}", f"run.dir={pdir / 'ftcore'}"]
        spec = {"epoch": True, "eval": True, "warmup": warmup}
        jobs.append(("ftcore.bench.worker", ft, spec, pdir / "ftcore", p.run.env))
    return jobs


def _launch(b: Bench, jobs: list, turns: int, what: str) -> tuple[list, list]:
    if turns > 0:
        log.info(
            "bench %s: %s, %d runs taking turns in %d slices", b.bench.name, what, len(jobs), turns
        )
        load0 = load_avg()
        outcomes = launch_taking_turns(jobs, turns, b.timeout_s)
        return outcomes, [[load0, load_avg()]] * len(jobs)
    outcomes, loads = [], []
    for job in jobs:
        log.info("bench %s: %s, %s", b.bench.name, what, job[3])
        load0 = load_avg()
        outcomes.append(launch(*job, b.timeout_s))
        loads.append([load0, load_avg()])
    return outcomes, loads


def flops_per_token(overrides: list[str]) -> float | None:
    """Model FLOPs per token of a pair's config (ftcore.planner.flops: 4N' for LoRA, 6N' plus
    attention for full training), the same number for both sides."""
    from ftcore.config.schema import compose
    from ftcore.planner.flops import model_flops_per_token
    from ftcore.validation.checks import with_hf_shapes

    return float(model_flops_per_token(with_hf_shapes(compose(overrides))))


def side_line(side: str, label: str, outcome: tuple, ctx: dict) -> dict:
    """One side's line from its result JSON (the HF recipe's or the worker's)."""
    res, err = outcome
    line = {"label": label, "side": side, **{k: v for k, v in ctx.items() if k != "gemm"},
            "gemm_flops_per_s": ctx["gemm"]["flops_per_s"], "gemm": ctx["gemm"]}  # fmt: skip
    if res is None:
        return {**line, "status": "failed", "error": err}
    if side == "ftcore":
        res = _ftcore_result(res)
    line.update(status="ok", **res)
    wall, cpu = line["wall_s"], line.get("cpu_s")
    line["tokens_per_s"] = line["tokens"] / wall
    line["tokens_per_cpu_s"] = line["tokens"] / cpu if cpu else None
    fpt, rate = ctx.get("flops_per_token"), ctx["gemm"]["flops_per_s"]
    line["model_flops_per_s"] = fpt * line["tokens_per_s"] if fpt else None
    line["efficiency"] = line["model_flops_per_s"] / rate if fpt and rate else None
    return line


def _ftcore_result(r: dict) -> dict:
    """The worker's epoch result in the HF recipe's terms (bench.steps' span, measured steps)."""
    span, steps = r.get("span") or {}, r["steps"]
    w = int(span.get("warmup_steps", 0))
    split = {p: sum(s["parts"].get(p, 0.0) for s in steps) for p in PARTS}
    return {
        "steps": len(steps), "warmup_steps": w, "measured_steps": span.get("measured_steps"),
        "wall_s": r["wall_s"], "cpu_s": r.get("cpu_s"), "waited_s": r.get("waited_s"),
        "cpu_waited_s": span.get("cpu_waited_s"),
        "tokens": sum(s["tokens"] for s in steps[w:]),
        "target_tokens": sum(s["target_tokens"] for s in steps[w:]),
        "epoch_tokens": sum(s["tokens"] for s in steps),
        "epoch_target_tokens": sum(s["target_tokens"] for s in steps),
        "groups_digest": span.get("groups_digest"),
        "train_loss": sum(s["loss"] for s in steps) / len(steps),  # mean of the steps' losses
        "eval_loss": r["eval_loss"], "eval_tokens": r["eval_tokens"],
        "peak_mem_gib": r["peak_mem_gib"], "threads": r.get("threads"),
        "time_split_s": split, "packing_efficiency": r["data_report"]["packing_efficiency"],
    }  # fmt: skip
