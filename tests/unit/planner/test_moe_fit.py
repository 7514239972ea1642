"""Hopper's MoE constants (ftcore/planner/moe_fit.py): they reproduce the one published row of each
model they were solved on, predict the held-out rows within what docs/planner.md claims, are the
best on their grid, and move no dense plan. Every number comes from tests/data/published_moe.csv."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ftcore.planner import calibration, fit, moe_fit

HELD_OUT_CLAIM = 0.05  # docs/planner.md: each held-out MoE row within 5%
FITTED_CLAIM = 0.005  # the fitted rows, to the rounding of the constants


@pytest.fixture(scope="module")
def pred():
    return fit.Predictor()


@pytest.fixture(scope="module")
def moe():
    return fit.load_rows(fit.MOE_CSV)


def shipped() -> moe_fit.MoeFit:
    h = calibration.HOPPER
    return moe_fit.MoeFit(h.expert_gemm_half_elems, h.ep_a2a_hidden)


def test_shipped_constants_reproduce_the_fitted_rows_and_the_held_out_within_the_claim(pred, moe):
    fitted = [r for r in moe if fit.row_key(r) in moe_fit.FITTED]
    held = [r for r in moe if fit.row_key(r) not in moe_fit.FITTED]
    assert len(fitted) == 2 and len(held) == 2  # one row of each model each way
    assert {r["model"] for r in fitted} == {r["model"] for r in held}
    for r in fitted:
        assert abs(moe_fit.error(pred, r)) < FITTED_CLAIM, fit.row_key(r)
    for r in held:
        assert abs(moe_fit.error(pred, r)) < HELD_OUT_CLAIM, fit.row_key(r)
    # the best point of the grid: one step of either constant, either way, is worse on the
    # fitted rows (so the shipped values are the solve's, rounded)
    k = shipped()
    worst = lambda c: max(abs(moe_fit.error(pred, r, c)) for r in fitted)  # noqa: E731
    for field, step in zip(("expert_gemm_half_elems", "ep_a2a_hidden"), moe_fit.GRID):
        for sign in (-1, 1):
            moved = replace(k, **{field: getattr(k, field) + sign * step})
            assert worst(moved) > worst(k), (field, sign)


def test_the_moe_constants_move_no_dense_plan(pred):
    """A dense row is predicted the same with the MoE constants at zero or far off."""
    row = fit.load_rows()[0]
    cfg = pred.cfg(row)
    base = pred(row)
    try:
        cfg.cluster.expert_gemm_half_elems, cfg.cluster.ep_a2a_hidden = 1e12, 1.0
        cfg.plan.moe_a2a_overlap = True
        from ftcore.planner.throughput import throughput

        assert throughput(cfg, int(row["num_gpus"]))["tokens_per_s_per_gpu"] == base
    finally:
        cfg.cluster.expert_gemm_half_elems = cfg.cluster.ep_a2a_hidden = None
        cfg.plan.moe_a2a_overlap = False
