"""The planner prices DPO (issue 44): the reference's forward in the step time, a pair's two rows in
the activations (unpacked), and full fine-tuning's frozen reference copy in the weights; the LoRA
reference (the adapters off) costs no memory; precompute_ref prices neither copy nor forward. Each plan is held against the same command with
objective=sft."""

from __future__ import annotations

import pytest

from ftcore import planner
from ftcore.config.schema import compose

LORA = ["+exp=70b_dpo_lora", "plan.enforce=false"]
FULL = ["+exp=70b_full", "data.format=preference", "plan.enforce=false"]


def _plan(over: list[str], objective: str) -> dict:
    extra = [] if objective == "dpo" else ["data.format=auto"]
    p = planner.plan(compose([*over, f"objective={objective}", *extra]))
    return {"step": p["step_time_s"], **p["memory_gib"]}


@pytest.mark.parametrize("packing", ["true", "false"])
def test_lora_dpo_prices_the_reference_forward_and_the_rows(packing):
    over = [*LORA, f"data.packing={packing}", "data.trim_padding=false"]
    sft, dpo = _plan(over, "sft"), _plan(over, "dpo")
    assert dpo["weights"] == sft["weights"] and dpo["optimizer"] == sft["optimizer"]
    rows = 1 if packing == "true" else 2  # unpacked: micro_batch_size counts pairs, two rows each
    assert dpo["activations"] == pytest.approx(rows * sft["activations"], rel=0.05)
    # The reference is one more forward per micro-batch: what full recompute prices for SFT on the
    # same rows, plus the reference's LM head (recompute has none), a small share of a 70B step.
    t = compose(over).train
    same_rows = [f"train.micro_batch_size={rows * t.micro_batch_size}",
                 f"train.global_batch_size={rows * t.global_batch_size}"]  # fmt: skip
    recomputed = _plan([*over, "parallel.recompute=full", *same_rows], "sft")
    assert 1.0 < dpo["step"] / recomputed["step"] < 1.03


def test_full_dpo_holds_a_frozen_copy_of_the_weights():
    sft, dpo = _plan(FULL, "sft"), _plan(FULL, "dpo")
    copy = compose([*FULL, "objective=dpo"])
    stages = planner.memory.all_stages(copy, copy.cluster.num_gpus)
    ref = max(s.parts["reference_weights"] for s in stages) / 2**30
    assert ref > 0 and dpo["weights"] == pytest.approx(sft["weights"] + ref, rel=1e-6)
    assert dpo["step"] > sft["step"]


@pytest.mark.parametrize("over", [FULL, LORA], ids=["full", "lora"])
def test_precomputed_reference_prices_no_copy_and_no_forward(over):
    """objective.precompute_ref: the SFT plan's weights and step time, and a label for the pass."""
    sft, pre = _plan(over, "sft"), _plan([*over, "objective.precompute_ref=true"], "dpo")
    assert pre["weights"] == sft["weights"] and pre["optimizer"] == sft["optimizer"]
    assert pre["step"] == pytest.approx(sft["step"], rel=0.02)  # both packed: the same rows
    p = planner.plan(compose([*over, "objective=dpo", "objective.precompute_ref=true"]))
    assert "one-time" in p["labels"]["dpo_reference"]
