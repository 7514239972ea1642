"""The planner's objective=grpo terms (planner/grpo.py): `ftcore.plan +exp=70b_grpo_lora` fits and
prices the rollout, the forward-only passes and the update apart, with the rollout's share of a
step; decoding is priced as memory-bandwidth-bound (its time follows the bytes read, not the rows),
the KV cache is counted in memory, sequence parallelism (no cache) is priced as recomputing, and
a full fine-tuning KL term keeps a reference copy."""

from __future__ import annotations

import pytest

from ftcore import planner
from ftcore.config.schema import compose
from ftcore.planner import grpo
from ftcore.planner.report import table


def _plan(*over: str) -> dict:
    cfg = compose(["+exp=70b_grpo_lora", *over])
    return planner.plan(cfg, planner.world_of(cfg))


def test_70b_grpo_lora_fits_and_prices_rollout_and_update_apart():
    p = _plan()
    g = p["grpo"]
    assert p["fits"]
    assert g["update_s"] == pytest.approx(p["step_time_s"])
    assert g["forward_only_passes"] == 0  # beta=0 and one update per rollout: no extra pass
    assert g["step_time_s"] == pytest.approx(g["rollout_s"] + g["update_s"])
    assert 0 < g["rollout_share"] < 1
    assert g["rollout_s"] > g["prefill_s"] > 0
    text = table(p)
    assert "the rollout is" in text and "ms per token (KV cache)" in text


def test_decode_is_bandwidth_bound_and_the_kv_cache_is_memory():
    base = _plan()["grpo"]["decode_token_s"]
    # twice the rows per replica: the weights are read once per token either way
    rows = _plan("train.global_batch_size=128")["grpo"]["decode_token_s"]
    assert base < rows < 1.3 * base
    # half the tensor parallelism: each GPU reads twice the weights per token
    tp4 = _plan("parallel.tp=4", "cluster.num_gpus=4")["grpo"]["decode_token_s"]
    assert 1.6 * base < tp4 < 2.4 * base
    cfg = compose(["+exp=70b_grpo_lora"])
    kv = grpo.kv_cache_bytes(cfg, 8, 0)
    assert kv == 80 * 64 * 1536 * 2 * (8 // 8) * 128 * 2  # layers x rows x positions x K,V
    stage = planner.plan(cfg, 8)["stages"][0]
    assert stage["parts"]["rollout_transient"] >= kv / 2**30
    assert stage["memory_gib"]["activations"] >= stage["parts"]["rollout_transient"]


def test_sequence_parallel_decodes_without_cache_and_iterations_amortise():
    sp = _plan("parallel.sp=true")["grpo"]
    assert (
        sp["kv_cache_recomputed"] and sp["decode_token_s"] > 5 * _plan()["grpo"]["decode_token_s"]
    )
    g = _plan("objective.beta=0.04", "objective.num_iterations=2")["grpo"]
    assert g["forward_only_passes"] == 2 and g["forward_only_s"] > 0
    assert g["step_time_s"] == pytest.approx(
        (g["rollout_s"] + g["forward_only_s"]) / 2 + g["update_s"]
    )


def test_full_fine_tuning_with_a_kl_term_keeps_a_reference_copy():
    over = ["+exp=8b_grpo_lora", "peft=none", "plan.enforce=false"]
    with_kl = planner.plan(compose([*over, "objective.beta=0.04"]), 8)
    without = planner.plan(compose(over), 8)
    ref = with_kl["stages"][0]["parts"]["reference_weights"]
    assert ref > 0 and without["stages"][0]["parts"]["reference_weights"] == 0
