"""`python -m ftcore.plan +exp=NAME [overrides] [plan.format=json] [plan.search=true]`.

Prints memory per pipeline stage, whether the job fits, the GPUs needed and the predicted speed.
Exits 0 whether or not it fits (2 only for config errors); with plan.format=json stdout is exactly
one JSON object and logs go to stderr. `plan.dry_build=true` also builds each distinct pipeline stage
on the meta device (ftcore/training/dry_build.py) and exits 2, after printing the plan, when a tensor
is off the device or a count differs from the planner's.
"""

from __future__ import annotations

import json

from omegaconf import DictConfig

from ftcore.cli import run
from ftcore.errors import FtcoreError


def task(cfg: DictConfig) -> int:
    from ftcore import planner
    from ftcore.config.ranges import check_ranges
    from ftcore.planner.layers import split_layers
    from ftcore.planner.report import table
    from ftcore.planner.search import search
    from ftcore.validation.checks import check_sequence, with_hf_shapes

    check_ranges(cfg)
    cfg = with_hf_shapes(cfg)  # model.hf_path given: its config.json's shapes, not the preset's

    if cfg.plan.format not in ("table", "json"):
        raise FtcoreError(
            f"unknown format {cfg.plan.format!r}", field="plan.format", fix="table or json"
        )
    p = cfg.parallel
    split_layers(cfg.model.num_layers, p.pp, p.vp)
    check_sequence(cfg)  # within the model's positions, cut the way the layout can (cp.py)
    world = planner.world_of(cfg)
    if world % (p.tp * p.pp * p.cp):
        raise FtcoreError(
            f"{world} GPUs do not divide by tp*pp*cp = {p.tp * p.pp * p.cp}",
            field="cluster.num_gpus",
            fix="use a multiple of parallel.tp * parallel.pp * parallel.cp",
        )
    result = planner.plan(cfg, world)
    ranked = search(cfg, world, cfg.plan.top) if cfg.plan.search else None
    built = None
    if cfg.plan.dry_build:
        from ftcore.training import dry_build

        built = result["dry_build"] = dry_build.dry_build(cfg, world)
    if cfg.plan.format == "json":
        if ranked is not None:
            result["search"] = ranked
        print(json.dumps(result), flush=True)
    else:
        print(table(result, ranked), flush=True)
    if built is not None:
        dry_build.check(built)  # after the plan is printed: exit 2 names what is wrong
    return 0


if __name__ == "__main__":
    run("plan", task)
