"""DPO on every layout (issue 44): five LoRA DPO steps at TP=2 (+SP), PP=2, DP=2 (distributed
optimizer) and CP=2 give the one-process losses and rewards/margins to 1e-5, and QLoRA DPO (the
NF4 base as reference) does at DP=2, from exactly log 2 at step 0; full fine-tuning DPO
(the frozen reference copy) does too at TP=2; a full fine-tuning DPO run stopped after 3 steps and
resumed gives the uninterrupted run's last two losses. The one-process references are shared; each run is the same
config with only the layout changed."""

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
LORA = ["peft=lora", "peft.r=4", "peft.lora_alpha=8", "optim.lr=5e-3",
        "peft.target_modules=[q_proj,v_proj,o_proj,down_proj]"]  # fmt: skip
FULL = ["optim.lr=1e-4", "sched.min_lr=0"]
# NF4 base (hidden 64, ffn 128: whole 64-value blocks), its reference the same base, adapters off
QLORA = ["peft=qlora", *LORA[1:]]
PRE = ["objective.precompute_ref=true"]  # the reference's log-probs from a stored first pass
METHODS = {"lora": LORA, "full": FULL, "qlora": QLORA}
LAYOUTS = {
    "tp2": ["parallel.tp=2", "parallel.sp=true"],
    "pp2": ["parallel.pp=2"],
    "dp2": ["parallel.distributed_optimizer=true"],
    "cp2": ["parallel.cp=2"],
}


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


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_dpo_layout_matches_one_process(layout, pool2, reference, tmp_path):
    got = pool2.run(steps_case, [*LORA, *LAYOUTS[layout]], str(tmp_path))[0]
    _agree(got, reference("lora"))


@pytest.mark.dist
def test_full_dpo_at_tp2_matches_one_process(pool2, reference, tmp_path):
    got = pool2.run(steps_case, [*FULL, *LAYOUTS["tp2"]], str(tmp_path))[0]
    _agree(got, reference("full"))


@pytest.mark.dist
def test_qlora_dpo_starts_at_log2_and_matches_one_process_at_dp2(pool2, reference, tmp_path):
    """Step 0 (B = 0): policy and reference are the same NF4 base, so both rewards are exactly 0
    and the sigmoid loss is log 2; then it trains, and DP=2 gives the one-process losses."""
    ref = reference("qlora")
    assert ref[0]["rewards"] == (0.0, 0.0), ref[0]
    assert math.isclose(ref[0]["loss"], math.log(2), rel_tol=1e-7), ref[0]
    assert all(math.isfinite(s["loss"]) for s in ref), ref
    assert all(0.0 not in s["rewards"] for s in ref[1:]), ref  # the adapters moved the policy
    got = pool2.run(steps_case, [*QLORA, *LAYOUTS["dp2"]], str(tmp_path))[0]
    _agree(got, ref)


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
    over = [*FULL, *LAYOUTS["dp2"]]
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
