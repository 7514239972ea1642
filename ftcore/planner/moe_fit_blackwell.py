"""The fit of Blackwell's MoE constants (calibration.py) to published Megatron-Bridge rows of the
releases on either side of 25.11, whose six rows are held out (tests/data/published_moe_blackwell.csv).

One set of Hopper constants cannot serve Blackwell (moe_fit.py's, on B200/GB200/GB300, put every
25.11 row too fast, by 56% at the median): Blackwell's GEMMs are 2.3x faster, so what does not
scale with FLOPs (small kernels, the host) is a larger share of a MoE step. Four constants
(moe_time.py says what each is):
- `expert_gemm_half_elems` (W½) and `ep_a2a_hidden`, as on Hopper;
- `moe_layer_latency_s`: a MoE layer's fixed kernel time per micro-batch;
- `expert_host_s`: the host's launch time per local expert after the dropless sync, one value for
  the x86 host of a DGX B200 (`x86`) and one for the Grace hosts of GB200 and GB300 (`grace`).
GB300's speed over GB200 is its dense constant (fit.py, fitted to its SFT and 405B rows), not a
MoE one.

The fit minimises the sum of squared log errors over the `fitted` rows (noisy rows of three
releases: the least-squares fit does not chase one of them), with a Nelder-Mead search from a
fixed start, each constant kept >= 0 (the hidden share <= 1), then rounded to GRID and polished
there one grid step at a time. It takes
about two minutes, so the tests check its result, not the search: the shipped constants are a
local optimum on the grid (test_moe_fit_blackwell.py). Rows of role `held out` never reach it.

`python -m ftcore.planner.moe_fit_blackwell` runs the fit and prints every row's error.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import astuple, dataclass, fields

from ftcore.planner import calibration, fit

HELD_OUT = "held out"
NAMES = ("expert_gemm_half_elems", "ep_a2a_hidden", "moe_layer_latency_s", "x86", "grace")
FIELDS = NAMES  # BlackwellFit's fields, in that order
SCALE = (1e7, 1.0, 1e-3, 1e-3, 1e-3)  # the search's unit of each constant
GRID = (1e5, 0.01, 1e-5, 1e-5, 1e-5)  # rounding of each


@dataclass(frozen=True)
class BlackwellFit:
    expert_gemm_half_elems: float
    ep_a2a_hidden: float
    moe_layer_latency_s: float
    x86: float  # expert_host_s of b200
    grace: float  # expert_host_s of gb200 and gb300


def shipped() -> BlackwellFit:
    k, b = calibration.BLACKWELL, calibration.B200
    return BlackwellFit(k.expert_gemm_half_elems, k.ep_a2a_hidden, k.moe_layer_latency_s,
                        b.expert_host_s, k.expert_host_s)  # fmt: skip


def rows(path=fit.MOE_BLACKWELL_CSV) -> list[dict]:
    return fit.load_rows(path)


def fitted(all_rows: list[dict]) -> list[dict]:
    return [r for r in all_rows if r["role"] != HELD_OUT]


def held_out(all_rows: list[dict]) -> list[dict]:
    return [r for r in all_rows if r["role"] == HELD_OUT]


def predict(pred: fit.Predictor, r: dict, k: BlackwellFit | None = None) -> float:
    """tokens/s/GPU of a row; k=None: the shipped constants. A padded row keeps its host term at 0
    (static shapes: no sync; its overrides say so)."""
    from ftcore.planner.throughput import throughput

    cfg = pred.cfg(r)
    c = cfg.cluster
    keys = ("expert_gemm_half_elems", "ep_a2a_hidden", "moe_layer_latency_s", "expert_host_s")
    if k is not None:
        host = 0.0 if r["dispatch"] == "padded" else k.x86 if r["gpu"] == "B200" else k.grace
        for key, v in zip(keys, (*astuple(k)[:3], host)):
            setattr(c, key, v)
    try:
        return throughput(cfg, int(r["num_gpus"]))["tokens_per_s_per_gpu"]
    finally:
        for key in keys[:3]:
            setattr(c, key, None)
        c.expert_host_s = 0.0 if r["dispatch"] == "padded" else None


def error(pred: fit.Predictor, r: dict, k: BlackwellFit | None = None) -> float:
    return predict(pred, r, k) / float(r["tokens_per_s_per_gpu"]) - 1


def cost(pred: fit.Predictor, rs: list[dict], k: BlackwellFit) -> float:
    """Sum of squared log errors: what the fit minimises."""
    return sum(math.log1p(error(pred, r, k)) ** 2 for r in rs)


def _from_unit(x: list[float]) -> BlackwellFit:
    v = [max(0.0, a) * s for a, s in zip(x, SCALE)]
    v[1] = min(v[1], 1.0)
    return BlackwellFit(*v)


def _nelder_mead(f, x0: list[float], iters: int = 300, step: float = 0.3) -> list[float]:
    """Minimise f from x0: the plain simplex method (reflect, expand, contract, shrink)."""
    n = len(x0)
    pts = [list(x0)] + [[x0[j] + (step if i == j else 0.0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        mid = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        worst = pts[-1]

        def toward(t: float, mid=mid, worst=worst) -> list[float]:
            return [mid[j] + t * (worst[j] - mid[j]) for j in range(n)]

        xr = toward(-1.0)
        fr = f(xr)
        if fr < vals[0]:
            xe = toward(-2.0)
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = toward(0.5)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                best = pts[0]
                pts = [best] + [
                    [best[j] + 0.5 * (p[j] - best[j]) for j in range(n)] for p in pts[1:]
                ]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[min(range(n + 1), key=vals.__getitem__)]


def solve(pred: fit.Predictor, all_rows: list[dict]) -> BlackwellFit:
    """The constants from the fitted rows only (the held-out rows are dropped first)."""
    rs = fitted(all_rows)
    assert rs and all(r["role"] != HELD_OUT for r in rs)
    x = _nelder_mead(lambda u: cost(pred, rs, _from_unit(u)), [0.5] * len(NAMES))
    k = BlackwellFit(*(round(round(v / g) * g, 10) for v, g in zip(astuple(_from_unit(x)), GRID)))
    return polish(pred, rs, k)


def polish(pred: fit.Predictor, rs: list[dict], k: BlackwellFit) -> BlackwellFit:
    """Grid steps of one constant at a time while one lowers the cost: the rounded simplex point
    becomes the best point of its grid neighbourhood."""
    best = cost(pred, rs, k)
    moved = True
    while moved:
        moved = False
        for i, step in enumerate(GRID):
            for sign in (-1, 1):
                v = list(astuple(k))
                v[i] = round(round((v[i] + sign * step) / step) * step, 10)
                if v[i] < 0 or (i == 1 and v[i] > 1):
                    continue
                c = cost(pred, rs, BlackwellFit(*v))
                if c < best:
                    k, best, moved = BlackwellFit(*v), c, True
    return k


def table(pred: fit.Predictor, all_rows: list[dict]) -> list[str]:
    """Every Blackwell MoE row with the shipped constants, then the held-out rows' median and
    worst absolute error."""
    from ftcore.planner.throughput import step_time

    out = [
        "| Blackwell MoE row | release | ep | gbs | mbs | dispatch | role | published "
        "| predicted | error | step: compute, all-to-all, host-bound of (s) |",
        "|---|---|---:|---:|---:|---|---|---:|---:|---:|---|",
    ]
    for r in all_rows:
        pub, got = float(r["tokens_per_s_per_gpu"]), predict(pred, r)
        st = step_time(pred.cfg(r), int(r["num_gpus"]))
        out.append(
            f"| {fit.row_id(r)} | {r['source'].split()[-1]} | {r['ep']} | {r['gbs']} | {r['mbs']} "
            f"| {r['dispatch']} | {r['role']} | {pub:.0f} | {got:.0f} | {got / pub - 1:+.1%} "
            f"| {st.compute_s:.1f}, {st.ep_comm_s:.1f}, {st.host_bound_s:.1f} of {st.total:.1f} |"
        )
    for name, sel in (("held out", held_out(all_rows)), ("fitted", fitted(all_rows))):
        errs = [abs(error(pred, r)) for r in sel]
        out.append(
            f"| {name} rows ({len(sel)}): median absolute error {statistics.median(errs):.1%}, "
            f"worst {max(errs):.1%} | | | | | | | | | | |"
        )
    return out


def without(all_rows: list[dict], release: str) -> list[dict]:
    """The rows less the fitted ones of one release (`--without 25.09`: how much the fit leans on
    it)."""
    return [r for r in all_rows if r["role"] == HELD_OUT or not r["source"].endswith(release)]


if __name__ == "__main__":
    import sys

    p, rs = fit.Predictor(), rows()
    if "--without" in sys.argv:
        rs = without(rs, sys.argv[sys.argv.index("--without") + 1])
        k = solve(p, rs)
        print(f"fitted without it: {k}")
        for r in held_out(rs):
            print(f"{fit.row_id(r)}: {error(p, r, k):+.1%}")
        errs = [abs(error(p, r, k)) for r in held_out(rs)]
        print(f"held out: median {statistics.median(errs):.1%}, worst {max(errs):.1%}")
        sys.exit(0)
    k, s = solve(p, rs), shipped()
    for f_ in fields(BlackwellFit):
        print(f"{f_.name}: fitted {getattr(k, f_.name):.6g} (shipped {getattr(s, f_.name):.6g})")
    print(f"cost on the fitted rows: fitted {cost(p, fitted(rs), k):.4f}, "
          f"shipped {cost(p, fitted(rs), s):.4f}\n")  # fmt: skip
    print("\n".join(table(p, rs)))
