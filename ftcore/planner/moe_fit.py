"""The fit of Hopper's two MoE constants (calibration.py) to one published MoE row of each model,
the other row of each held out.

Two models, two constants, one row each: the 25.11 rows (FITTED) determine
- `expert_gemm_half_elems`: the expert weight size (hidden x width / etp) at which an expert's
  GEMMs run at half the large-GEMM efficiency, mostly set by Qwen3-30B-A3B (2048 x 768 experts);
- `ep_a2a_hidden`: the share of the all-to-all megatron's overlap_moe_expert_parallel_comm hides
  (every published MoE recipe turns it on, with delay_wgrad_compute), mostly set by
  Qwen3-235B-A22B (ep=32 over four nodes).
Both rows are solved exactly (each prediction falls with the first constant and rises with the
second), then rounded to GRID. The 26.02 rows are predicted with the result. No dense row moves:
neither constant applies without routed experts.

`python -m ftcore.planner.moe_fit` prints the fit and every MoE row's error (docs/planner.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ftcore.planner import fit

FITTED = (  # Megatron-Bridge 25.11, one row per model
    "qwen3_30b_a3b-pretrain-16xH100-gbs512-mbs2",
    "qwen3_235b_a22b-pretrain-256xH100-gbs2048-mbs1",
)
GRID = (1e5, 0.01)  # rounding of (expert_gemm_half_elems, ep_a2a_hidden)


@dataclass(frozen=True)
class MoeFit:
    expert_gemm_half_elems: float
    ep_a2a_hidden: float


def predict(pred: fit.Predictor, r: dict, k: MoeFit | None = None) -> float:
    """tokens/s/GPU of a MoE row; k=None: the shipped constants."""
    from ftcore.planner.throughput import throughput

    cfg = pred.cfg(r)
    c = cfg.cluster
    if k is not None:
        c.expert_gemm_half_elems, c.ep_a2a_hidden = k.expert_gemm_half_elems, k.ep_a2a_hidden
    try:
        return throughput(cfg, int(r["num_gpus"]))["tokens_per_s_per_gpu"]
    finally:
        c.expert_gemm_half_elems = c.ep_a2a_hidden = None


def error(pred: fit.Predictor, r: dict, k: MoeFit | None = None) -> float:
    return predict(pred, r, k) / float(r["tokens_per_s_per_gpu"]) - 1


def _bisect(f, lo: float, hi: float, steps: int = 40) -> float:
    """The root of f, increasing on [lo, hi] (the nearer end where it has none)."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def solve(pred: fit.Predictor, rows: list[dict]) -> MoeFit:
    """Both constants from the FITTED rows of `rows`, exact, then rounded to GRID."""
    small, large = (next(r for r in rows if fit.row_key(r) == key) for key in FITTED)

    def half_for(hidden: float) -> float:  # the small-expert row exact at this hidden share
        return _bisect(lambda w: -error(pred, small, MoeFit(w, hidden)), 0.0, 1e9)

    hidden = _bisect(lambda h: error(pred, large, MoeFit(half_for(h), h)), 0.0, 1.0, steps=20)
    w = half_for(hidden)
    return MoeFit(round(w / GRID[0]) * GRID[0], round(hidden / GRID[1]) * GRID[1])


def table(pred: fit.Predictor, rows: list[dict]) -> list[str]:
    """Every MoE row: fitted or held out, published, predicted with the shipped constants."""
    from ftcore.planner.throughput import step_time

    out = [
        "| MoE row | ep | gbs | mbs | role | published | predicted (shipped) | error "
        "| predicted step: compute, exposed all-to-all (s) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        pub, got = float(r["tokens_per_s_per_gpu"]), predict(pred, r)
        st = step_time(pred.cfg(r), int(r["num_gpus"]))
        role = "fitted" if fit.row_key(r) in FITTED else "held out"
        out.append(
            f"| {fit.row_id(r)} | {r['ep']} | {r['gbs']} | {r['mbs']} | {role} | {pub:.0f} "
            f"| {got:.0f} | {got / pub - 1:+.1%} "
            f"| {st.compute_s:.1f}, {st.ep_comm_s:.1f} of {st.total:.1f} |"
        )
    return out


if __name__ == "__main__":
    from ftcore.planner import calibration

    p, moe = fit.Predictor(), fit.load_rows(fit.MOE_CSV)
    k, h = solve(p, moe), calibration.HOPPER
    print(
        f"fitted to {', '.join(FITTED)}: expert_gemm_half_elems {k.expert_gemm_half_elems:.0f} "
        f"(shipped {h.expert_gemm_half_elems:.0f}), ep_a2a_hidden {k.ep_a2a_hidden:.2f} "
        f"(shipped {h.ep_a2a_hidden:.2f})\n"
    )
    print("\n".join(table(p, moe)))
