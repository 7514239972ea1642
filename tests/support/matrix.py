"""The parity matrix: every switch that changes the training path, crossed with every layout, from
one table (docs/parallelism.md shows it; tests/unit/test_parity_matrix.py checks it).

Each factor has named settings (command-line overrides each). A run picks one setting per factor;
`runs()` covers every pair of settings of two factors that some valid run can hold (all-pairs,
greedy, deterministic), after the SEEDS: triples that pairs alone would not force, each a bug the
crossing hunts found. Each run is the one-process command with only the layout keys changed: its
oracle is the same command, WHAT factors only, on one process (`reference_command`).

- WHAT factors change the math (model, objective and its DPO reference, loss, PEFT, rows): they
  pick the reference. HOW factors change only where and when it is computed (optimizer sharding
  and its overlaps, recompute, TP/SP, PP/VP, CP, EP, DP).
- Every key declared with `switch(...)` in the schema (ftcore/config/groups.py) must be set by some
  factor's settings: the unit test fails otherwise, so a new training-path key joins the table.
- Pairs ftcore refuses (validation, exit 2) are REFUSED: no run holds them, and a test checks
  that validation refuses each.
- The models are at least as awkward as the shipped tiny base, never shaped so a feature agrees:
  the dense model is that base (ffn 704: a TP=2 down_proj shard is 352 columns, 5.5 NF4 blocks),
  the MoE model a random Qwen3-MoE of transformers (tests/support/moe.py: head_dim != hidden /
  heads, a dense layer of ffn 96 among the experts of ffn 48), the DeepSeek-V3 model a random one
  of transformers (tests/support/deepseek.py: latent attention with YaRN, a shared expert, grouped
  sigmoid routing with a non-zero expert bias that the run moves, a dense first layer).
"""

from __future__ import annotations

import functools
import itertools
import math

STEPS = 3
# +exp=tiny_full at fp32; one evaluation at the end (the in-training evaluation path)
BASE = (
    "+exp=tiny_full", "precision=fp32", "data.seq_len=64", "data.max_samples=32",
    f"train.max_steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=2",
    "sched.warmup_steps=0", "sched.min_lr=0", f"eval.interval={STEPS}", "eval.iters=1",
    "checkpoint.save_at_end=false", "logger.progress=lines",
)  # fmt: skip
ALL7 = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# LoRA targets: every linear; on the MoE model the experts' and the router's too (peft/experts.py)
MLA = "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,up_proj,down_proj"
LORA_TARGETS = {"dense": f"[{ALL7}]", "moe": f"[{ALL7},gate]", "deepseek": f"[{MLA}]"}
LORA = ("peft=lora", "peft.r=4", "peft.lora_alpha=8", "optim.lr=3e-3")
# QLoRA keeps the default target, linear_qkv: one A shared by q, k and v
QLORA = ("peft=qlora", "peft.double_quant=false", "peft.r=4", "peft.lora_alpha=8", "optim.lr=3e-3")
DPO = ("objective=dpo", "data.format=preference")
DISTOPT = ("parallel.distributed_optimizer=true",)
OVERLAP = (
    *DISTOPT,
    "parallel.overlap_grad_reduce=true",
    "parallel.overlap_param_gather=true",
    "parallel.overlap_p2p_comm=true",
)  # fmt: skip  (p2p: a no-op but under PP x VP)
# a large auxiliary loss and a z-loss: a mis-scaled router gradient shows in the LM loss
MOE = ("model.hf_path={moe}", "moe.aux_loss_coeff=0.1", "moe.z_loss_coeff=0.001")
# aux-loss-free balancing on: the expert bias moves each step by the tokens each expert got, summed
# over TP x DP x CP, so a layout that counted tokens otherwise would route otherwise
DEEPSEEK = (
    "model.hf_path={deepseek}",
    "moe.aux_loss_coeff=0.05",
    "moe.expert_bias_update_rate=0.01",
)

# factor -> setting -> overrides ({moe}, {adapter}: paths the test makes). WHAT factors first.
FACTORS: dict[str, dict[str, tuple[str, ...]]] = {
    "model": {"dense": ("model.init_path=tiny_base",), "moe": MOE, "deepseek": DEEPSEEK},
    "objective": {
        "sft": (),
        # the reference: the base with the adapters off (LoRA, QLoRA), a frozen copy (full)
        "dpo": DPO,
        "dpo_ref_adapter": (*DPO, "objective.ref_adapter_path={adapter}"),
        "dpo_precompute": (*DPO, "objective.precompute_ref=true"),
    },
    # DPO losses by path: sigmoid reads the sequence sums; ipo and sft the token counts too
    "loss": {
        "next_token": (),  # SFT's own: the only one it has
        "sigmoid": ("objective.loss_type=[sigmoid]",),
        "ipo+sft": ("objective.loss_type=[ipo,sft]",),
    },
    # full fine-tuning at a full fine-tuning learning rate (DPO at tiny_full's 2e-3 moves the
    # rewards by 0.6 in two steps: rounding then grows ~50x a step, 1.5e-4 in the third's norm)
    "peft": {"none": ("optim.lr=1e-4",), "lora": LORA, "qlora": QLORA},
    "rows": {"packed": ("data.packing=true",), "unpacked": ("data.packing=false",)},
    "optimizer": {"plain": (), "distopt": DISTOPT, "overlap": OVERLAP},
    "recompute": {
        "none": (),
        "selective": ("parallel.recompute=selective",),
        "full": ("parallel.recompute=full",),
    },
    "tp": {"1": (), "2": ("parallel.tp=2",), "2+sp": ("parallel.tp=2", "parallel.sp=true")},
    # pp=2 as uneven stages: one layer on the first, three on the last (every model has 4;
    # DeepSeek's dense first layer alone on stage 0, its MoE layers 1-3 built from the global
    # offset). The even pp=2 split is megatron's default path, which 2xvp2 takes (2+2 chunks)
    "pp": {
        "1": (),
        "2uneven": (
            "parallel.pp=2",
            "parallel.pp_first_stage_layers=1",
            "parallel.pp_last_stage_layers=3",
        ),
        "2xvp2": ("parallel.pp=2", "parallel.vp=2"),
    },  # fmt: skip
    "cp": {"1": (), "2": ("parallel.cp=2",)},
    "ep": {"1": (), "2": ("parallel.ep=2",)},
    "dp": {"1": (), "2": ()},  # dp is what the world leaves (the pool's size)
}
WHAT = ("model", "objective", "loss", "peft", "rows")
LAYOUT = ("tp", "pp", "cp", "dp")  # their product is the world; ep splits the experts over it
MAX_WORLD = 4  # two cores: at most two parallel axes at 2 each
# schema switches a setting changes without naming them: the MoE checkpoint's config.json gives
# model.num_experts (hf/config.py); the matrix test checks the MoE runs had it
DERIVED = {"model.num_experts": "model"}

# values of the training-path switches that are not settings of the table yet, and what tests
# them meanwhile (tests/unit/test_parity_matrix.py: every value validation accepts is a setting
# or here)
ELSEWHERE = {
    ("objective.name", "grpo"): "tests/multiproc/test_grpo_parity.py: TP=2+SP, PP=2 and DP=2 with "
    "the distributed optimizer and both overlaps, LoRA, unpacked (GRPO refuses packing, CP, VP, "
    "MoE and evaluation, so it joins as an objective setting with its own data and no evaluation)",
}

# pairs ftcore's validation refuses (exit 2): the field its error names, and why. No run holds
# them; tests/multiproc/test_parity_matrix.py checks each is refused before anything is built.
DPO_MOE = ("objective", "DPO on a mixture of experts is not built yet")
REFUSED = {
    **{(("model", m), ("objective", o)): DPO_MOE
       for m in ("moe", "deepseek") for o in ("dpo", "dpo_ref_adapter", "dpo_precompute")},
    **{(("model", m), ("peft", "qlora")): ("peft.name", "QLoRA's NF4 linears are not experts")
       for m in ("moe", "deepseek")},
    (("model", "dense"), ("ep", "2")): ("parallel.ep", "expert parallelism needs experts"),
    **{(("model", m), ("tp", "2")): ("parallel.sp", "megatron's MoE layer needs SP under TP")
       for m in ("moe", "deepseek")},
    (("objective", "dpo_ref_adapter"), ("peft", "none")):
        ("objective.ref_adapter_path", "a reference adapter needs adapters"),
}  # fmt: skip

# Runs every table must hold: triples the crossing hunts found broken (issue 50), which pairs
# alone would not force (each is the factor values given; the rest as `_fill` completes it)
SEEDS = (
    # the reference-adapter swap with the overlapped param gather: wrong at DP=2 ...
    {"model": "dense", "objective": "dpo_ref_adapter", "loss": "sigmoid", "peft": "lora",
     "optimizer": "overlap", "pp": "1", "dp": "2"},
    # ... right at PP=2 x VP=2 x DP=2 (the interleaved schedule gathers again)
    {"model": "dense", "objective": "dpo_ref_adapter", "loss": "sigmoid", "peft": "lora",
     "optimizer": "overlap", "pp": "2xvp2", "dp": "2"},
    # QLoRA at TP=2 on the tiny base: a down_proj shard of 5.5 NF4 blocks
    {"model": "dense", "objective": "sft", "peft": "qlora", "tp": "2", "cp": "1", "pp": "1"},
    # unpacked DPO at PP=2: two rows per pair through the pipeline
    {"model": "dense", "objective": "dpo", "loss": "sigmoid", "peft": "lora", "rows": "unpacked",
     "pp": "2uneven", "tp": "1"},
    # LoRA on the experts at ep=2 x tp=2 (SP): the expert adapters' gradient norm
    {"model": "moe", "objective": "sft", "peft": "lora", "ep": "2", "tp": "2+sp", "pp": "1"},
    # DeepSeek-V3 (issue 53) at ep=2 x tp=2 and ep=2 x pp=2, the expert bias moving
    {"model": "deepseek", "peft": "none", "ep": "2", "tp": "2+sp", "pp": "1", "cp": "1"},
    {"model": "deepseek", "peft": "lora", "ep": "2", "pp": "2uneven", "tp": "1", "cp": "1"},
)  # fmt: skip


def world(run: dict[str, str]) -> int:
    return math.prod(2 if run[f] != "1" else 1 for f in LAYOUT)


def refused(run: dict[str, str]) -> list[tuple]:
    """The REFUSED pairs the run holds."""
    return [(a, b) for a, b in REFUSED if run[a[0]] == a[1] and run[b[0]] == b[1]]


def unfit(run: dict[str, str]) -> str | None:
    """Why a run is not made, apart from refusals: None for a run worth making."""
    if (run["objective"] == "sft") != (run["loss"] == "next_token"):
        return "the DPO loss is for DPO only"
    if world(run) == 1:
        return "one process: the reference itself"
    if world(run) > MAX_WORLD:
        return f"more than {MAX_WORLD} processes"
    if run["ep"] == "2" and all(run[f] == "1" for f in ("tp", "cp", "dp")):
        return "ep=2 needs two ranks per pipeline stage to split the experts over"
    if run["optimizer"] != "plain" and run["dp"] == "1" and run["cp"] == "1":
        return "the distributed optimizer has no data-parallel group to shard over"
    return None


def valid(run: dict[str, str]) -> bool:
    return not refused(run) and unfit(run) is None


# -- all-pairs ---------------------------------------------------------------------------------

NAMES = list(FACTORS)
ITEMS = [(f, v) for f in NAMES for v in FACTORS[f]]
_BIT = {
    pair: i
    for i, pair in enumerate((a, b) for a, b in itertools.combinations(ITEMS, 2) if a[0] != b[0])
}


def pairs(run: dict[str, str]) -> set[tuple]:
    items = [(f, run[f]) for f in NAMES]
    return set(itertools.combinations(items, 2))


def _mask(run: dict[str, str]) -> int:
    m = 0
    for p in pairs(run):
        m |= 1 << _BIT[p]
    return m


@functools.cache
def _combos() -> list[dict[str, str]]:
    """Every valid run: WHAT settings x HOW settings, those `valid` keeps, in table order."""
    what = [dict(zip(WHAT, vs)) for vs in itertools.product(*(FACTORS[f] for f in WHAT))]
    how_names = [f for f in NAMES if f not in WHAT]
    how = [dict(zip(how_names, vs)) for vs in itertools.product(*(FACTORS[f] for f in how_names))]
    out = []
    for w in what:
        if any(refused_pair(w, a, b) for a, b in REFUSED):
            continue
        for h in how:
            run = {f: {**w, **h}[f] for f in NAMES}
            if valid(run):
                out.append(run)
    return out


def refused_pair(partial: dict, a: tuple, b: tuple) -> bool:
    return partial.get(a[0]) == a[1] and partial.get(b[0]) == b[1]


def _fill(seed: dict[str, str], combos: list[dict[str, str]]) -> dict[str, str]:
    """The first valid run (table order, smallest world) holding the seed's values."""
    held = [c for c in combos if all(c[f] == v for f, v in seed.items())]
    if not held:
        raise ValueError(f"no valid run holds the seed {seed}")
    return min(held, key=world)


@functools.cache
def runs() -> list[dict[str, str]]:
    """SEEDS, then greedy all-pairs: repeatedly the valid run covering the most pairs not yet
    covered; ties: the one whose reference (WHAT settings) another run already has, then the
    smaller world, then table order. Only pairs some valid run holds count."""
    combos = _combos()
    masks = [_mask(c) for c in combos]
    todo = 0
    for m in masks:
        todo |= m
    chosen = [_fill(s, combos) for s in SEEDS]
    refs = {reference_key(r) for r in chosen}
    for r in chosen:
        todo &= ~_mask(r)
    while todo:
        best = max(
            range(len(combos)),
            key=lambda i: ((masks[i] & todo).bit_count(), reference_key(combos[i]) in refs,
                           -world(combos[i]), -i),
        )  # fmt: skip
        chosen.append(combos[best])
        refs.add(reference_key(combos[best]))
        todo &= ~masks[best]
    return chosen


def feasible_pairs() -> set[tuple]:
    return set().union(*(pairs(c) for c in _combos()))


# -- commands ----------------------------------------------------------------------------------


def name(run: dict[str, str]) -> str:
    """A test id `pytest -k` can select: WHAT values, then each HOW factor and value."""
    parts = [run[f] for f in WHAT] + [f"{f}{run[f]}" for f in NAMES if f not in WHAT]
    return "-".join(parts).replace("+", "_")


def _overrides(run: dict[str, str], factors, paths: dict[str, str]) -> list[str]:
    over = [o for f in factors for o in FACTORS[f][run[f]]]
    if run["peft"] == "lora":
        over.append(f"peft.target_modules={LORA_TARGETS[run['model']]}")
    return [o.format(**paths) for o in over]


def command(run: dict[str, str], paths: dict[str, str]) -> list[str]:
    """The run's ftcore.train overrides (run.dir apart); `paths`: {moe}, {adapter}."""
    return [*BASE, *_overrides(run, NAMES, paths)]


def reference_key(run: dict[str, str]) -> tuple[str, ...]:
    return tuple(run[f] for f in WHAT)


def reference_command(key: tuple[str, ...], paths: dict[str, str]) -> list[str]:
    """The one-process command: the same WHAT settings, no HOW overrides."""
    run = dict(zip(WHAT, key))
    return [*BASE, *_overrides(run, WHAT, paths)]


def override_keys(overrides) -> set[str]:
    """The config keys overrides set: `peft=lora` picks conf/peft/lora.yaml, which sets
    peft.name (every group's files name themselves)."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return {k if "." in k else f"{k}.name" for k in keys}


def setting_keys(factor: str, factors: dict | None = None) -> set[str]:
    """The config keys a factor's settings set on the command line."""
    return {k for s in (factors or FACTORS)[factor].values() for k in override_keys(s)}


def table_markdown() -> str:
    """The runs as docs/parallelism.md shows them (a test checks the page against this)."""
    head = ["run", *NAMES, "processes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    seeds = len(SEEDS)
    for i, r in enumerate(runs(), 1):
        label = f"{i}{'*' if i <= seeds else ''}"
        lines.append("| " + " | ".join([label, *(r[f] for f in NAMES), str(world(r))]) + " |")
    return "\n".join(lines)


def refused_markdown() -> str:
    lines = ["| pair | the error names | because |", "|---|---|---|"]
    for (a, b), (field, why) in REFUSED.items():
        lines.append(f"| {a[0]}={a[1]} x {b[0]}={b[1]} | `{field}` | {why} |")
    return "\n".join(lines)


def holes() -> list[tuple]:
    """Pairs of settings no valid run holds (refused, or ruled out by `unfit`)."""
    return sorted(set(_BIT) - feasible_pairs())


def holes_markdown() -> str:
    """The holes, each with why: a refusal, SFT's loss, or what the refusals imply (a DPO loss
    means DPO, ep=2 means the MoE model)."""
    lines = ["| pair no run holds | because |", "|---|---|"]
    for a, b in holes():
        if (a, b) in REFUSED:
            why = f"refused: {REFUSED[(a, b)][1]}"
        elif "loss" in (a[0], b[0]) and "objective" in (a[0], b[0]):
            why = "the DPO losses are DPO's; SFT has its next-token loss"
        else:
            why = "implied by the refusals"
        lines.append(f"| {a[0]}={a[1]} x {b[0]}={b[1]} | {why} |")
    return "\n".join(lines)
