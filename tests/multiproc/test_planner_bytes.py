"""The planner's model-state bytes equal what megatron allocates, to the byte, on every rank."""

from __future__ import annotations

import pytest

from ftcore.config.schema import compose
from ftcore.planner.memory import model_state
from tests.support.planner_probe import state_case
from tests.support.tiny import TINY

ODD = ["model.hidden_size=72", "model.ffn_hidden_size=136", "model.num_attention_heads=4"]
ALL = "linear_qkv,linear_proj,linear_fc1,linear_fc2"
# a mixture of experts (layer 1 dense): expert weights in buffers of their own over the expert DP
MOE = ["model.family=qwen3_moe", "model.num_experts=4", "model.moe_ffn_hidden_size=40",
       "model.moe_dense_layers=[1]", "parallel.ep=2"]  # fmt: skip
CASES = {
    1: [[], ["precision=bf16"], ["parallel.recompute=full"]],
    2: [
        ["parallel.tp=2"],
        ["parallel.tp=2", "parallel.sp=true", "precision=bf16"],
        ["parallel.pp=2"],
        ["parallel.pp=2", "parallel.vp=2"],
        ["parallel.distributed_optimizer=true"],
        ["parallel.distributed_optimizer=true", "precision=bf16"],
        ["parallel.distributed_optimizer=true", *ODD],
        ["parallel.pp=2", "model.num_layers=6"],
        ["peft=lora"],
        ["peft=lora", "peft.target_modules=[q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"],
        ["peft=lora", "parallel.tp=2", "parallel.sp=true", f"peft.target_modules=[{ALL}]"],
        [
            "peft=lora",
            "parallel.distributed_optimizer=true",
            "precision=bf16",
            "peft.target_modules=[k_proj,linear_fc2]",
        ],
        ["peft=lora", "parallel.pp=2", "parallel.vp=2", f"peft.target_modules=[{ALL}]"],
        # the families' extras (q/k/v bias, [head_dim] q/k norms) inside the DDP buffer's shards
        ["model.family=qwen2", "parallel.tp=2", "parallel.distributed_optimizer=true", *ODD],
        ["model.family=qwen3", "model.kv_channels=24", "parallel.distributed_optimizer=true"],
        ["model.family=qwen2", "peft=lora", "parallel.tp=2", f"peft.target_modules=[{ALL}]"],
        [*MOE, "parallel.tp=2", "parallel.sp=true", "parallel.distributed_optimizer=true"],
    ],
    4: [
        [*MOE, "parallel.distributed_optimizer=true", "precision=bf16"],
        ["parallel.tp=2", "parallel.distributed_optimizer=true", "precision=bf16"],
        ["parallel.pp=2", "parallel.distributed_optimizer=true", *ODD],
        ["parallel.pp=2", "parallel.vp=2", "parallel.tp=2", "parallel.distributed_optimizer=true"],
    ],
}


def _check(results: list[dict], overrides: list[str], world: int) -> None:
    cfg = compose(TINY + overrides)
    p = cfg.parallel
    dp = world // (p.tp * p.pp * p.cp)
    for r in results:
        want = model_state(cfg, r["pp_rank"], dp * p.cp, r["dp_rank"])
        got = {k: r[k] for k in ("weights", "grads", "optimizer")}
        assert {k: want[k] for k in got} == got, (overrides, r["pp_rank"], r["dp_rank"])


@pytest.mark.dist
@pytest.mark.parametrize("overrides", CASES[1], ids=str)
def test_model_state_exact_1(pool1, tmp_path, overrides):
    _check(pool1.run(state_case, overrides, str(tmp_path)), overrides, 1)


@pytest.mark.dist
@pytest.mark.parametrize("overrides", CASES[2], ids=str)
def test_model_state_exact_2(pool2, tmp_path, overrides):
    _check(pool2.run(state_case, overrides, str(tmp_path)), overrides, 2)


@pytest.mark.dist
@pytest.mark.parametrize("overrides", CASES[4], ids=str)
def test_model_state_exact_4(pool4, tmp_path, overrides):
    _check(pool4.run(state_case, overrides, str(tmp_path)), overrides, 4)
