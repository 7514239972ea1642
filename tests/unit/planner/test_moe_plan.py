"""The planner's MoE terms as megatron lays a MoE model out: experts split over ep, the
all-to-all priced on the link its EP peers share, the routed activations at the stated imbalance
(or the capacity factor), and the search over ep. The bytes themselves are checked against
megatron's allocation in tests/multiproc/test_planner_bytes.py."""

from __future__ import annotations

import pytest

from ftcore.config.schema import compose
from ftcore.planner import activations as act
from ftcore.planner import search
from ftcore.planner.memory import model_state
from ftcore.planner.throughput import step_time
from ftcore.planner.view import replace, view


@pytest.fixture(scope="module")
def lora30():
    return view(compose(["+exp=qwen3_30b_a3b_lora"]))  # 8 H100, ep=8, dp=8


def test_each_ep_rank_holds_its_share_of_the_experts(lora30):
    """ep=4 holds 32 of the 128 experts per layer, ep=8 16: the frozen bytes differ by 16 experts
    x 48 layers x (gate, up, down) of 2048 x 768 in bf16; the rest of the model is the same."""
    ep4 = model_state(replace(lora30, parallel={"ep": 4}), 0, 8)
    ep8 = model_state(lora30, 0, 8)
    assert ep4["frozen"] - ep8["frozen"] == 16 * 48 * 3 * 2048 * 768 * 2
    # each expert's adapters are its own: 16 more experts' A and B (r=16), as trainable state
    per_expert = 16 * (2048 + 768) * 2 + 16 * (768 + 2048)  # gate, up: own A, B; down: A, B
    assert ep4["elements"] - ep8["elements"] == 16 * 48 * (3 * 2048 * 768 + per_expert)


def test_expert_optimizer_state_shards_over_the_expert_data_parallel_group():
    """Full fine-tuning on 16 GPUs, pp=1, distributed optimizer: the experts' Adam state is
    sharded over world / (pp x ep) ranks (megatron's expert data-parallel group). ep=16 holds half
    the experts of ep=8 but shards them over 1 rank instead of 2: the same optimizer bytes."""
    cfg = view(compose(["+exp=qwen3_235b_a22b_full", "model=qwen3_30b_a3b", "cluster.num_gpus=16",
                        "parallel.tp=1", "parallel.sp=false", "parallel.pp=1", "parallel.ep=8"]))  # fmt: skip
    s8 = model_state(cfg, 0, 16)
    s16 = model_state(replace(cfg, parallel={"ep": 16}), 0, 16)
    assert s8["expert_grads"] == 2 * s16["expert_grads"]  # 16 experts per layer vs 8
    assert s8["optimizer"] == pytest.approx(s16["optimizer"], rel=1e-6)
    # without it every rank keeps its experts' whole state (fp32 main + 2 moments: 12 B each)
    plain = {ep: model_state(replace(cfg, parallel={"ep": ep, "distributed_optimizer": False}),
                             0, 16)["optimizer"] for ep in (8, 16)}  # fmt: skip
    assert plain[8] - plain[16] == 8 * 48 * 3 * 2048 * 768 * 12


def test_all_to_all_is_priced_on_the_link_its_peers_share():
    """ep=8 over one node of 8 is NVLink only: a slower network does not move it. ep=16 puts half
    of each rank's peers on another node: the network time decides its all-to-all."""
    base = ["+exp=qwen3_235b_a22b_full", "model=qwen3_30b_a3b", "cluster.num_gpus=16",
            "parallel.tp=1", "parallel.sp=false", "parallel.pp=1", "parallel.recompute=full"]  # fmt: skip

    def a2a(ep: int, network: float) -> float:
        cfg = compose([*base, f"parallel.ep={ep}", f"cluster.network_gbps={network}"])
        return step_time(view(cfg), 16).ep_comm_s

    assert a2a(8, 25.0) == a2a(8, 50.0) > 0
    assert a2a(16, 25.0) == pytest.approx(2 * a2a(16, 50.0))
    assert a2a(16, 50.0) > a2a(8, 50.0)


def test_routed_tokens_follow_the_imbalance_or_the_capacity_factor(lora30):
    mean = replace(lora30, plan={"moe_imbalance": 1.0})
    skewed = replace(lora30, plan={"moe_imbalance": 2.0})
    capped = replace(skewed, moe={"capacity_factor": 1.25})
    routed = {k: act.moe_tokens(act.shape_of(c))[1] for k, c in
              dict(mean=mean, skewed=skewed, capped=capped).items()}  # fmt: skip
    assert routed["mean"] == 4096 * 8  # every token's top-8 copies, spread evenly
    assert routed == dict(mean=4096 * 8, skewed=2 * 4096 * 8, capped=1.25 * 4096 * 8)
    parts = {k: act.moe_parts(act.shape_of(c)) for k, c in dict(mean=mean, skewed=skewed).items()}
    assert parts["skewed"]["swiglu"] == 2 * parts["mean"]["swiglu"]
    assert parts["skewed"]["router"] == parts["mean"]["router"]  # the router sees its own tokens


def test_search_varies_ep_and_names_it(lora30):
    lays = list(search.layouts(lora30, 8, vary_recompute=False))
    assert {lay["ep"] for lay in lays} == {1, 2, 4, 8}
    row = dict(lays[0], dp=1, sp=False)
    assert f"parallel.ep={row['ep']} parallel.etp={row['etp']}" in search.overrides(row)
    dense = view(compose(["+exp=70b_lora"]))
    assert all("ep" not in lay for lay in search.layouts(dense, 8, vary_recompute=False))
