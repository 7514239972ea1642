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


def layout_problem(cfg: DictConfig, world: int) -> FtcoreError | None:
    """Why the config's own layout cannot run on `world` GPUs (the layers do not split, the
    sequence does not cut, the GPUs do not divide), or None."""
    from ftcore.planner.layers import split_for
    from ftcore.validation.checks import check_sequence

    p = cfg.parallel
    try:
        split_for(cfg)
        check_sequence(cfg)  # within the model's positions, cut the way the layout can (cp.py)
    except FtcoreError as e:
        return e
    if world % (p.tp * p.pp * p.cp):
        return FtcoreError(
            f"{world} GPUs do not divide by tp*pp*cp = {p.tp * p.pp * p.cp}",
            field="cluster.num_gpus",
            fix="use a multiple of parallel.tp * parallel.pp * parallel.cp, or plan.search=true "
            "to search the layouts of that many GPUs",
        )
    return None


def with_layout(cfg: DictConfig, row: dict) -> DictConfig:
    """The config with a searched row's layout (what its overrides select)."""
    cfg = cfg.copy()
    keys = ("tp", "pp", "vp", "cp", "sp", "recompute", "ep", "etp", "cp_comm_type",
            "pp_first_stage_layers", "pp_last_stage_layers")  # fmt: skip
    for key in keys:
        if key in row:
            cfg.parallel[key] = row[key]
    cfg.train.micro_batch_size = row["micro_batch_size"]
    return cfg


def task(cfg: DictConfig) -> int:
    from ftcore import planner
    from ftcore.config.ranges import check_ranges
    from ftcore.planner.report import table
    from ftcore.planner.search import search
    from ftcore.validation.checks import with_hf_shapes

    check_ranges(cfg)
    cfg = with_hf_shapes(cfg)  # model.hf_path given: its config.json's shapes, not the preset's

    if cfg.plan.format not in ("table", "json"):
        raise FtcoreError(
            f"unknown format {cfg.plan.format!r}", field="plan.format", fix="table or json"
        )
    world = planner.world_of(cfg)
    problem = layout_problem(cfg, world)
    if problem is not None and not cfg.plan.search:
        raise problem
    # plan.search: the layout is free. The config's own is planned where it can run; where it
    # cannot, the search's fastest layout is; where none fits, the search runs again at the
    # fewest GPUs that fit (the count the plan prints), so its advice can be followed as printed.
    ranked = search(cfg, world, cfg.plan.top) if cfg.plan.search else None
    fewest = None
    if cfg.plan.search and not ranked:
        needed = planner.gpus_needed(cfg)
        if needed and needed != world:
            fewest = {"num_gpus": needed, "rows": search(cfg, needed, cfg.plan.top)}
    notes, shown, shown_world = [], cfg, world
    if problem is not None:
        best = ranked[0] if ranked else (fewest["rows"][0] if fewest and fewest["rows"] else None)
        if best is None:
            raise problem
        shown_world = world if ranked else fewest["num_gpus"]
        shown = with_layout(cfg, best)
        why = str(problem).split(" -- fix: ")[0]
        notes.append(f"the config's layout cannot run on {world} GPUs ({why}): the "
                     f"plan below is the search's fastest layout on {shown_world}: "
                     f"{best['overrides']}")  # fmt: skip
    result = planner.plan(shown, shown_world)
    built = None
    if cfg.plan.dry_build:
        from ftcore.training import dry_build

        built = result["dry_build"] = dry_build.dry_build(shown, shown_world)
    if notes:
        result["notes"] = notes
    if cfg.plan.format == "json":
        if ranked is not None:
            result["search"] = ranked
            result["search_num_gpus"] = world
        if fewest is not None:
            result["search_at_fewest"] = fewest
        print(json.dumps(result), flush=True)
    else:
        print(table(result, ranked, search_world=world, fewest=fewest), flush=True)
    if built is not None:
        dry_build.check(built)  # after the plan is printed: exit 2 names what is wrong
    return 0


if __name__ == "__main__":
    run("plan", task)
