"""DPO beyond the parity matrix (which runs every DPO reference kind, full/LoRA/QLoRA and both loss
paths at every layout against one process: tests/multiproc/test_parity_matrix.py): a full
fine-tuning DPO run stopped after 3 steps and resumed gives the uninterrupted run's losses (its
reference stays the starting weights); objective.precompute_ref computes its pass once, stores
it, reads it back on resume and under another layout, and evaluates the held-out pairs with it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ftcore.config.schema import assets_dir
from tests.support.tiny import TINY

STEPS = 5
DATA = str(Path(assets_dir(), "data", "preference_train.jsonl"))
BASE = [*TINY, "objective=dpo", "data.format=preference", f"data.path={DATA}", "data.seq_len=64",
        "data.max_samples=24",  # the 5 steps' 20 pairs and a few: precompute_ref's pass reads all
        "train.global_batch_size=4", "train.micro_batch_size=1",
        "sched.warmup_steps=0", f"train.max_steps={STEPS}"]  # fmt: skip
FULL = ["optim.lr=1e-4", "sched.min_lr=0"]
PRE = ["objective.precompute_ref=true"]  # the reference's log-probs from a stored first pass
METHODS = {"full": FULL}
DP2 = ["parallel.distributed_optimizer=true"]


def steps_case(overrides: list[str], run_dir: str, resume_at: int = 0) -> list[dict]:
    """Worker: the run's per-step loss and rewards/margins (resume_at: stop and save after that
    many steps, then a fresh setup resumes from the checkpoint and runs to the end)."""
    from ftcore.checkpoint import store
    from ftcore.config.schema import compose
    from ftcore.training import trainer

    def run(stop: int) -> list[dict]:
        state = trainer.setup(compose([*BASE, *overrides, f"run.dir={run_dir}"]))
        out = []
        while state.step < stop:
            r = trainer.train_step(state)
            state.step += 1
            m = r["metrics"]
            out.append({
                "loss": r["loss"], "margin": m["rewards/margins"], "logps": m["logps/chosen"],
                "rewards": (m["rewards/chosen"], m["rewards/rejected"]),
            })  # fmt: skip
        if resume_at:
            store.save(state, blocking=True)
            store.wait(state)
        return out

    if not resume_at:
        return run(STEPS)
    first = run(resume_at)
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return first + run(STEPS)


@pytest.fixture(scope="module")
def reference(pool1, tmp_path_factory):
    cache = {}

    def get(method: str) -> list[dict]:
        if method not in cache:
            d = tmp_path_factory.mktemp(f"ref-{method}")
            cache[method] = pool1.run(steps_case, METHODS[method], str(d))[0]
        return cache[method]

    return get


def counted_case(overrides: list[str], run_dir: str, resume_at: int = 0) -> dict:
    """Worker: steps_case, and how many reference passes (precompute_ref) the run computed."""
    from ftcore.training.objectives.dpo import ref_store

    real, calls = ref_store._compute, []

    def compute(*a, **k):
        calls.append(1)
        return real(*a, **k)

    ref_store._compute = compute
    try:
        return {"steps": steps_case(overrides, run_dir, resume_at), "passes": len(calls)}
    finally:
        ref_store._compute = real


def _agree(got: list[dict], ref: list[dict], rel: float = 1e-5) -> None:
    assert len(got) == len(ref) == STEPS
    for g, r in zip(got, ref):
        assert math.isclose(g["loss"], r["loss"], rel_tol=rel), (got, ref)
        assert math.isclose(g["logps"], r["logps"], rel_tol=rel), (got, ref)
        # a margin is a difference of log-prob sums (~ -40): their rounding, times beta
        assert math.isclose(g["margin"], r["margin"], rel_tol=rel, abs_tol=1e-6), (got, ref)
    assert max(abs(r["margin"]) for r in ref) > 1e-3, "the steps trained nothing"


def test_resumed_dpo_run_gives_the_uninterrupted_losses(pool1, reference, tmp_path):
    """Full fine-tuning: the resumed run's reference is the starting weights, not the restored."""
    got = pool1.run(steps_case, FULL, str(tmp_path), resume_at=3)[0]
    _agree(got, reference("full"))


def test_precomputed_reference_gives_the_frozen_copy_losses_and_resumes(pool1, reference, tmp_path):
    """Full fine-tuning, one process, only objective.precompute_ref changed: the frozen copy's
    losses to 1e-6; stopped after 3 steps and resumed, the run reads the stored pass back."""
    got = pool1.run(counted_case, [*FULL, *PRE], str(tmp_path), resume_at=3)[0]
    _agree(got["steps"], reference("full"), rel=1e-6)
    assert got["passes"] == 1 and (tmp_path / "reference_logps.pt").is_file()


@pytest.mark.dist
def test_precomputed_reference_at_dp2_gives_the_frozen_copy_losses(pool1, pool2, tmp_path):
    """DP=2 (distributed optimizer): each rank computes its share of the pass; a one-process run
    in the same run.dir (re-sharded) reads the stored pass instead of running it."""
    over = [*FULL, *DP2]
    frozen = pool2.run(steps_case, over, str(tmp_path / "frozen"))[0]
    got = pool2.run(steps_case, [*over, *PRE], str(tmp_path / "pre"))[0]
    _agree(got, frozen, rel=1e-6)
    one = pool1.run(counted_case, [*FULL, *PRE], str(tmp_path / "pre"))[0]
    assert one["passes"] == 0
    _agree(one["steps"], got)


def eval_case(overrides: list[str], run_dir: str) -> dict:
    """Worker: two steps, then the held-out pairs' loss and metrics."""
    from ftcore.config.schema import compose
    from ftcore.training import trainer
    from ftcore.training.evaluation import evaluate

    over = [*BASE, *FULL, "data.val_fraction=0.2", "eval.interval=2", *overrides]
    state = trainer.setup(compose([*over, f"run.dir={run_dir}"]))
    for _ in range(2):
        trainer.train_step(state)
        state.step += 1
    r = evaluate(state, state.val_batches)
    return {"loss": r.loss, "pairs": r.pairs, **r.metrics}


def test_precomputed_reference_evaluates_the_held_out_pairs(pool1, tmp_path):
    """The held-out pairs' reference log-probs come from the same first pass: after two steps
    (the policy moved), evaluation gives the frozen copy's values."""
    frozen = pool1.run(eval_case, [], str(tmp_path / "frozen"))[0]
    got = pool1.run(eval_case, PRE, str(tmp_path / "pre"))[0]
    assert got["pairs"] == frozen["pairs"] > 0 and abs(frozen["rewards/margins"]) > 1e-4
    for k, v in frozen.items():
        assert math.isclose(got[k], v, rel_tol=1e-6, abs_tol=1e-9), (k, got, frozen)
