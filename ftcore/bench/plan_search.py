"""bench kind `plan_search`: how long `python -m ftcore.plan +exp=NAME plan.search=true` takes.

Each run (an experiment's overrides) is planned with the search in a fresh process, timed wall to
wall (interpreter start, composing the config, the plan, the fewest GPUs that fit and the search),
then again at the fewest GPUs that fit when the plan names another count: the planner's own advice
must answer as fast. Rounds repeat the list so that a slow phase of a shared VM falls on every
run; the report gives each run's median and worst (docs/planner.md quotes it).
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import time

from ftcore.bench.runner import Bench, expand_runs, load_avg

log = logging.getLogger("ftcore")


def _timed(overrides: list[str], timeout_s: float) -> tuple[float, dict | None, str]:
    """(wall seconds, the plan's JSON or None, error text) of one planner process."""
    cmd = [sys.executable, "-m", "ftcore.plan", *overrides, "plan.search=true", "plan.format=json"]
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t, None, f"timeout after {timeout_s:.0f} s"
    wall = time.perf_counter() - t
    if r.returncode != 0:
        return (
            wall,
            None,
            r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}",
        )
    return wall, json.loads(r.stdout), ""


def run_plan_search(b: Bench) -> None:
    bench = b.bench
    for k in range(max(1, int(bench.repeats))):
        for run in expand_runs(bench):
            ov = [*bench.base, *run.overrides, *b.extra]
            counts = [None]
            while counts:
                n = counts.pop(0)
                extra = [f"cluster.num_gpus={n}"] if n else []
                load0 = load_avg()
                wall, plan, err = _timed([*ov, *extra], b.timeout_s)
                line = {"label": run.label + (f" @{n}" if n else ""), "round": k + 1,
                        "wall_s": wall, "load_avg": [load0, load_avg()]}  # fmt: skip
                if plan is None:
                    b.append({**line, "status": "failed", "error": err})
                    continue
                b.append({**line, "status": "ok", "num_gpus": plan["search_num_gpus"],
                          "rows": len(plan["search"]), "gpus_needed": plan["gpus_needed"]})  # fmt: skip
                needed = plan["gpus_needed"]
                if n is None and needed and needed != plan["search_num_gpus"]:
                    counts.append(needed)  # the count the plan advises: searched as printed


def plan_search_md(lines: list[dict]) -> list[str]:
    out = ["| run | GPUs searched | layouts shown | wall s (median) | wall s (worst) | rounds |",
           "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for label in dict.fromkeys(ln["label"] for ln in lines):
        mine = [ln for ln in lines if ln["label"] == label]
        ok = [ln for ln in mine if ln.get("status") == "ok"]
        if not ok:
            out.append(f"| {label} | | | failed: {mine[-1].get('error')} | | {len(mine)} |")
            continue
        walls = [ln["wall_s"] for ln in ok]
        out.append(f"| {label} | {ok[-1]['num_gpus']} | {ok[-1]['rows']} | "
                   f"{statistics.median(walls):.1f} | {max(walls):.1f} | {len(mine)} |")  # fmt: skip
    walls = [ln["wall_s"] for ln in lines if ln.get("status") == "ok"]
    if walls:
        out += ["", f"Every run: median {statistics.median(walls):.1f} s, worst {max(walls):.1f} s "
                f"over {len(walls)} processes ({sum(ln.get('status') != 'ok' for ln in lines)} "
                "failed)."]  # fmt: skip
    return out
