"""The fit of the GPU speed constants of calibration.py to the published rows, as code, and its
leave-one-out check: each row predicted by constants fitted without it.

What is fitted: `matmul_efficiency`, one per GPU family, to the family's rows of
tests/data/published_throughput.csv, minimising the worst |log(predicted / published)| (the
docs state each row's error, so the fit keeps the largest one small) over a 0.01 grid.
What is not: `attention_efficiency` is held at a set value per family (HELD). Left free, the four
H100 rows drive it to 1.0 of the bf16 peak, beyond what flash attention reaches (FA3: ~75% of
the H100 bf16 peak forward, less backward): the rows hardly separate attention time from GEMM
time, so they cannot fit it. The exposed traffic shares of throughput.py, the 0.05 s step
overhead and the reserves are not refitted here either (see docs/planner.md).

A family with no row to fit (GB200 left out: Blackwell has one row) borrows the constants fitted
to the nearest family that has rows (NEAREST), the way the planner treats a GPU nobody published.

Held out altogether: the rows of tests/data/published_heldout.csv (published, never fitted to)
are predicted with the shipped constants, each with its recipe's flags (`held_out_table`). The
MoE rows of tests/data/published_moe.csv fit Hopper's two MoE constants, one row per model, the
others held out: moe_fit.py, which prints their table.

`python -m ftcore.planner.fit` prints the in-sample, leave-one-out and held-out tables of
docs/planner.md.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from ftcore.planner import calibration

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
ROWS_CSV = DATA / "published_throughput.csv"  # the rows the constants are fitted to
HELD_OUT_CSV = DATA / "published_heldout.csv"  # published rows never fitted to
MOE_CSV = DATA / "published_moe.csv"  # published MoE rows (moe_fit.py)
MOE_BLACKWELL_CSV = DATA / "published_moe_blackwell.csv"  # moe_fit.py: Blackwell rows
PRECISION = {"fp8": "fp8_delayed", "fp8_cs": "fp8_cs", "bf16": "bf16", "mxfp8": "mxfp8"}
# GB300 (Blackwell Ultra) has GB200's datasheet FP8/BF16 peaks but runs ~20% faster on every
# published layout both ran (1400 W against 1200 W: higher sustained clocks), so it is a family of
# its own, fitted to its own rows; B200 shares GB200's constants (its lower datasheet peaks are its
# lower clocks).
FAMILIES = {
    "hopper": ("h100", "h200"),
    "blackwell": ("gb200", "b200"),
    "blackwell_ultra": ("gb300",),
}
HELD = {"hopper": 0.6, "blackwell": 0.55, "blackwell_ultra": 0.55}  # attention: set, not fitted
NEAREST = {"blackwell": "hopper", "hopper": "blackwell", "blackwell_ultra": "blackwell"}
GRID = (30, 95)  # matmul_efficiency searched over 0.30 ... 0.95 in steps of 0.01


def load_rows(path: Path = ROWS_CSV) -> list[dict]:
    """The published rows (comment lines skipped)."""
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def row_id(r: dict) -> str:
    return f"{r['model']}-{r['task']}-{r['num_gpus']}x{r['gpu']}"


def row_key(r: dict) -> str:
    """row_id and the batch: two releases may publish one layout at two batch sizes."""
    return f"{row_id(r)}-gbs{r['gbs']}-mbs{r['mbs']}"


def family(r: dict) -> str:
    gpu = r["gpu"].lower()
    return next(f for f, gpus in FAMILIES.items() if gpu in gpus)


def recipe_speed_flags(r: dict) -> list[str]:
    """The speed options the published recipe ran with (Megatron-Bridge's CommOverlapConfig and
    perf recipes; NeMo's for the 24.07 row): TE userbuffers wherever TP > 1 with SP, pipeline sends
    overlapped under interleaving, DP reduce and gather overlapped wherever DP > 1, bf16 gradient
    buffers, no CUDA graphs priced (the planner has no term for them)."""
    tp, pp, vp, cp = (int(r[k]) for k in ("tp", "pp", "vp", "cp"))
    dp = int(r["num_gpus"]) // (tp * pp * cp)
    on = lambda b: str(bool(b)).lower()  # noqa: E731
    return [
        f"parallel.tp_comm_overlap={on(tp > 1)}",
        f"parallel.overlap_p2p_comm={on(pp > 1 and vp > 1)}",
        f"parallel.overlap_grad_reduce={on(dp > 1)}",
        f"parallel.overlap_param_gather={on(dp > 1)}",
        "parallel.distributed_optimizer=true",
        "perf.grad_reduce_dtype=bf16",
    ]


def overrides(r: dict) -> tuple[str, list[str]]:
    """(exp, overrides) reproducing one published row."""
    lora = r["task"] == "lora"
    ov = [
        f"model={r['model']}",
        f"peft={'lora' if lora else 'none'}",
        f"precision={PRECISION[r['precision']]}",
        f"cluster={r['gpu'].lower()}",
        f"cluster.num_gpus={r['num_gpus']}",
        f"parallel.tp={r['tp']}",
        f"parallel.pp={r['pp']}",
        f"parallel.vp={r['vp']}",
        f"parallel.cp={r['cp']}",
        f"parallel.sp={str(int(r['tp']) > 1).lower()}",
        "parallel.recompute=none",
        f"data.seq_len={r['seq_len']}",
        f"train.global_batch_size={r['gbs']}",
        f"train.micro_batch_size={r['mbs']}",
    ]
    if lora:
        ov.append("peft.target_modules=[linear_qkv]")
    if int(r.get("ep") or 1) > 1:  # MoE rows: published with the experts' load forced balanced
        ov += [f"parallel.ep={r['ep']}", "parallel.etp=1", "plan.moe_imbalance=1.0"]
        ov.append("plan.moe_a2a_overlap=true")  # the recipes' moe_a2a_overlap (moe_fit.py)
        if r.get("dispatch") == "padded":  # capacity 1.0, padded: static shapes, no host sync
            ov += ["moe.capacity_factor=1.0", "cluster.expert_host_s=0"]
    return ("70b_lora" if lora else "70b_full"), ov + recipe_speed_flags(r)


def _cfg_key(r: dict) -> str:
    """What makes a row's overrides: two releases may publish one layout and batch with another
    precision or dispatch."""
    return f"{row_key(r)}-{r['precision']}-{r.get('dispatch') or ''}"


class Predictor:
    """tokens/s/GPU of a row under given constants; each row composed once, each point memoised."""

    def __init__(self):
        self._cfgs: dict[str, object] = {}
        self._memo: dict[tuple, float] = {}

    def cfg(self, r: dict):
        key = _cfg_key(r)
        if key not in self._cfgs:
            from ftcore.config.schema import compose

            exp, ov = overrides(r)
            self._cfgs[key] = compose([f"+exp={exp}", *ov])
        return self._cfgs[key]

    def __call__(self, r: dict, matmul: float | None = None, attention: float | None = None):
        """None: the shipped constants of calibration.py (what the planner says today)."""
        from ftcore.planner.throughput import throughput

        key = (_cfg_key(r), matmul, attention)
        if key not in self._memo:
            cfg = self.cfg(r)
            cfg.cluster.matmul_efficiency, cfg.cluster.attention_efficiency = matmul, attention
            try:
                self._memo[key] = throughput(cfg, int(r["num_gpus"]))["tokens_per_s_per_gpu"]
            finally:
                cfg.cluster.matmul_efficiency = cfg.cluster.attention_efficiency = None
        return self._memo[key]


def log_error(pred: Predictor, r: dict, matmul=None, attention=None) -> float:
    return math.log(pred(r, matmul, attention) / float(r["tokens_per_s_per_gpu"]))


@dataclass(frozen=True)
class Fitted:
    matmul_efficiency: float
    attention_efficiency: float
    rows: tuple[str, ...]  # the row ids it was fitted to

    def worst(self, pred: Predictor, rows: list[dict]) -> float:
        m, a = self.matmul_efficiency, self.attention_efficiency
        return max(abs(log_error(pred, r, m, a)) for r in rows)


def fit_family(pred: Predictor, fam: str, rows: list[dict]) -> Fitted:
    """matmul_efficiency minimising the worst |log error| over `rows` (all of family `fam`), with
    attention_efficiency held at HELD[fam]. Each row's prediction grows with the efficiency, so the
    worst error is unimodal in it: a ternary search over the integer grid."""
    if not rows:
        raise ValueError(f"no rows to fit {fam} on")
    a = HELD[fam]

    def cost(i: int) -> float:
        return max(abs(log_error(pred, r, i / 100, a)) for r in rows)

    lo, hi = GRID
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if cost(m1) <= cost(m2):
            hi = m2
        else:
            lo = m1
    best = min(range(lo, hi + 1), key=cost)
    if best in GRID:
        raise ValueError(f"{fam}: the fit reached the edge of the grid ({best / 100})")
    return Fitted(best / 100, a, tuple(row_id(r) for r in rows))


def fit(pred: Predictor, rows: list[dict]) -> dict[str, Fitted]:
    """One Fitted per family that has rows."""
    out = {}
    for fam in FAMILIES:
        mine = [r for r in rows if family(r) == fam]
        if mine:
            out[fam] = fit_family(pred, fam, mine)
    return out


def shipped(fam: str) -> calibration.Calibration:
    return calibration.CALIBRATIONS[FAMILIES[fam][0]]


@dataclass(frozen=True)
class Held:
    """One row left out: its prediction by the constants fitted to the other rows."""

    row: dict
    published: float
    in_sample: float  # with the shipped constants (fitted with this row among the others)
    held_out: float
    constants: Fitted
    source: str  # "fitted to the other <family> rows" | "borrowed: ..." (no row of its family left)


def leave_one_out(pred: Predictor, rows: list[dict]) -> list[Held]:
    out = []
    for i, r in enumerate(rows):
        others = rows[:i] + rows[i + 1 :]
        fam = family(r)
        same = [o for o in others if family(o) == fam]
        if same:
            k, source = fit_family(pred, fam, same), f"fitted to the other {len(same)} {fam} rows"
        else:
            near = NEAREST[fam]
            k = fit_family(pred, near, [o for o in others if family(o) == near])
            source = f"borrowed: {near}'s constants (no other {fam} row)"
        held = pred(r, k.matmul_efficiency, k.attention_efficiency)
        pub = float(r["tokens_per_s_per_gpu"])
        out.append(Held(r, pub, pred(r), held, k, source))
    return out


def abs_error(pred: float, pub: float) -> float:
    return abs(pred / pub - 1)


def tables(pred: Predictor, rows: list[dict]) -> list[str]:
    """The markdown of docs/planner.md: constants fitted vs shipped, then per row in-sample beside
    held out, with the median absolute errors."""
    out = [
        "| family | rows | matmul_efficiency fitted (shipped) | attention_efficiency (held) "
        "| worst error fitted (shipped) |",
        "|---|---:|---:|---:|---:|",
    ]
    for fam, k in fit(pred, rows).items():
        mine = [r for r in rows if family(r) == fam]
        s = shipped(fam)
        worst_s = max(abs(log_error(pred, r)) for r in mine)
        out.append(
            f"| {fam} | {len(mine)} | {k.matmul_efficiency:.2f} ({s.matmul_efficiency:.2f}) "
            f"| {k.attention_efficiency:.2f} | {math.expm1(k.worst(pred, mine)):.1%} "
            f"({math.expm1(worst_s):.1%}) |"
        )
    out += [
        "",
        "| published row | published | in-sample (shipped) | error | held out | error "
        "| held-out constants (matmul, attention) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    loo = leave_one_out(pred, rows)
    for h in loo:
        k = h.constants
        out.append(
            f"| {row_id(h.row)} | {h.published:.0f} | {h.in_sample:.0f} "
            f"| {h.in_sample / h.published - 1:+.1%} | {h.held_out:.0f} "
            f"| {h.held_out / h.published - 1:+.1%} "
            f"| {k.matmul_efficiency:.2f}, {k.attention_efficiency:.2f}: {h.source} |"
        )
    own = [h for h in loo if not h.source.startswith("borrowed")]
    for name, sel in (("all rows", loo), ("rows whose family has another row", own)):
        ins = statistics.median(abs_error(h.in_sample, h.published) for h in sel)
        held = statistics.median(abs_error(h.held_out, h.published) for h in sel)
        out.append(
            f"| median absolute error, {name} ({len(sel)}) | | | {ins:.1%} | | {held:.1%} | |"
        )
    return out


def held_out_table(pred: Predictor, rows: list[dict]) -> list[str]:
    """The published rows no constant was fitted to, predicted with the shipped constants."""
    out = [
        "| held-out row | gbs | published | predicted (shipped) | error | source |",
        "|---|---:|---:|---:|---:|---|",
    ]
    errs = []
    for r in rows:
        pub, got = float(r["tokens_per_s_per_gpu"]), pred(r)
        errs.append(abs_error(got, pub))
        out.append(
            f"| {row_id(r)} | {r['gbs']} | {pub:.0f} | {got:.0f} | {got / pub - 1:+.1%} "
            f"| {r['source']} |"
        )
    out.append(f"| median absolute error ({len(errs)} rows) | | | | "
               f"{statistics.median(errs):.1%} | worst {max(errs):.1%} |")  # fmt: skip
    return out


if __name__ == "__main__":
    p = Predictor()
    print("\n".join(tables(p, load_rows()) + [""] + held_out_table(p, load_rows(HELD_OUT_CSV))))
