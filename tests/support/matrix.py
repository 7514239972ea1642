"""The parity matrix: features crossed with layouts, covered pairwise, from one table.

Each factor below has named settings (a list of command-line overrides each). A run picks one
setting per factor; `runs()` is a small deterministic all-pairs generator: every pair of settings
of two factors that some valid run can hold appears in at least one run. Each run is a real
`python -m ftcore.train` command, compared with the one-process run of the same command with the
HOW factors (layout, optimizer sharding and overlap, recompute) left out: they change how the
math is laid out, never the math, so six references (method x rows) serve every run.
"""

from __future__ import annotations

import itertools
import math

# +exp=tiny_full at fp32, 3 steps; ffn 768 keeps every 64-value NF4 block inside one TP shard
BASE = (
    "+exp=tiny_full", "precision=fp32", "model.ffn_hidden_size=768", "model.allow_random_base=true",
    "data.seq_len=64", "train.max_steps=3", "train.global_batch_size=8",
    "train.micro_batch_size=2", "sched.warmup_steps=0", "eval.interval=0",
    "checkpoint.save_at_end=false",
)  # fmt: skip
LORA = ("peft.r=4", "peft.lora_alpha=8", "optim.lr=3e-3")
ALL7 = "peft.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
DISTOPT = ("parallel.distributed_optimizer=true",)
OVERLAP = (*DISTOPT, "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true")

# factor -> setting -> overrides. WHAT factors first (they pick the reference), then HOW factors.
FACTORS: dict[str, dict[str, tuple[str, ...]]] = {
    "method": {
        "full": (),
        "lora": ("peft=lora", *LORA, ALL7),  # qlora keeps the default: a shared A on linear_qkv
        "qlora": ("peft=qlora", "peft.double_quant=false", *LORA),
    },
    "rows": {"packed": ("data.packing=true",), "unpacked": ("data.packing=false",)},
    "optimizer": {"plain": (), "distopt": DISTOPT, "overlap": OVERLAP},
    "recompute": {"none": (), "full": ("parallel.recompute=full",)},
    "tp": {"1": (), "2+sp": ("parallel.tp=2", "parallel.sp=true")},
    "pp": {"1": (), "2": ("parallel.pp=2",), "2xvp2": ("parallel.pp=2", "parallel.vp=2")},
    "cp": {"1": (), "2": ("parallel.cp=2",)},
    "dp": {"1": (), "2": ()},  # dp is what the world leaves (launcher.nproc_per_node)
}
WHAT = ("method", "rows")
LAYOUT = ("tp", "pp", "cp", "dp")
MAX_WORLD = 4  # two cores: at most two parallel axes at 2 each


def world(run: dict[str, str]) -> int:
    return math.prod(2 if run[f] != "1" else 1 for f in LAYOUT)


def valid(run: dict[str, str]) -> bool:
    """A run worth making: fits MAX_WORLD processes, and the distributed optimizer (and its
    overlaps) has a data-parallel group to shard over (dp x cp)."""
    if world(run) > MAX_WORLD:
        return False
    if run["optimizer"] != "plain" and run["dp"] == "1" and run["cp"] == "1":
        return False
    return True


def _combos() -> list[dict[str, str]]:
    names = list(FACTORS)
    out = []
    for values in itertools.product(*(list(FACTORS[f]) for f in names)):
        run = dict(zip(names, values))
        if world(run) > 1 and valid(run):
            out.append(run)
    return out


def _pairs(run: dict[str, str]) -> set[tuple]:
    items = sorted(run.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def runs() -> list[dict[str, str]]:
    """Greedy all-pairs: repeatedly the valid run covering the most pairs not yet covered (ties:
    the smaller world, then table order). Deterministic; only pairs some valid run holds count."""
    combos = _combos()
    todo = set().union(*(_pairs(c) for c in combos))
    chosen = []
    while todo:
        best = max(combos, key=lambda c: (len(_pairs(c) & todo), -world(c)))
        chosen.append(best)
        todo -= _pairs(best)
    return chosen


def feasible_pairs() -> set[tuple]:
    return set().union(*(_pairs(c) for c in _combos()))


def name(run: dict[str, str]) -> str:
    return "-".join(f"{f}={run[f]}" for f in FACTORS)


def command(run: dict[str, str]) -> list[str]:
    """The run's ftcore.train overrides (run.dir apart)."""
    over = [o for f in FACTORS for o in FACTORS[f][run[f]]]
    return [*BASE, *over, f"launcher.nproc_per_node={world(run)}"]


def reference_key(run: dict[str, str]) -> tuple[str, ...]:
    return tuple(run[f] for f in WHAT)


def reference_command(key: tuple[str, ...]) -> list[str]:
    """The one-process command: the same WHAT settings, no HOW overrides."""
    return [*BASE, *(o for f, v in zip(WHAT, key) for o in FACTORS[f][v])]


def table_markdown() -> str:
    """The runs as docs/parallelism.md shows them (a test checks the page against this)."""
    head = ["run", *FACTORS, "processes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(runs(), 1):
        lines.append("| " + " | ".join([str(i), *(r[f] for f in FACTORS), str(world(r))]) + " |")
    return "\n".join(lines)
