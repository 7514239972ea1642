"""The planner's MoE parameter counts (params.total_params / active_params) against the oracle:
transformers' own Qwen3-MoE and Mixtral models, built tiny here, counted with numel; then the
shipped big configs against their model cards' totals."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from ftcore.config.schema import compose
from ftcore.planner.params import active_params, total_params

SHAPE = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)


def _hf_counts(model, top_k: int, num_experts: int) -> tuple[int, int]:
    """(every parameter, those one token passes through: top_k of each layer's experts)."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, total - experts + experts * top_k // num_experts


def _planned(overrides: list[str]):
    cfg = compose(["+exp=tiny_full", *overrides])
    return total_params(cfg), active_params(cfg)


CASES = {
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(**SHAPE, head_dim=12, intermediate_size=80, moe_intermediate_size=24,
                       num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                       mlp_only_layers=[1], tie_word_embeddings=False),
        ["model.family=qwen3_moe", "model.kv_channels=12", "model.ffn_hidden_size=80",
         "model.moe_ffn_hidden_size=24", "model.num_layers=4", "model.moe_dense_layers=[1]"],
    ),
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(**SHAPE, intermediate_size=40, num_hidden_layers=3, num_local_experts=4,
                      num_experts_per_tok=2, tie_word_embeddings=False),
        ["model.family=mixtral", "model.ffn_hidden_size=40", "model.moe_ffn_hidden_size=40",
         "model.num_layers=3"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_counts_equal_transformers_model(name):
    cls, hf_cfg, overrides = CASES[name]
    torch.manual_seed(0)
    total, active = _hf_counts(cls(hf_cfg), 2, 4)
    common = ["model.vocab_size=96", "model.hidden_size=32", "model.num_attention_heads=4",
              "model.num_query_groups=2", "model.num_experts=4", "model.moe_router_topk=2",
              "model.tie_embeddings=false"]  # fmt: skip
    assert _planned(common + overrides) == (total, active)


@pytest.mark.parametrize(
    "model, total_b, active_b",
    [("qwen3_30b_a3b", 30.5, 3.3), ("qwen3_235b_a22b", 235, 22), ("mixtral_8x22b", 141, 39)],
)
def test_shipped_configs_match_the_model_cards(model, total_b, active_b):
    """The cards round: within 2% of their totals (Qwen3-30B-A3B's 3.35 B active is "3.3B")."""
    total, active = _planned([f"model={model}"])
    assert total / 1e9 == pytest.approx(total_b, rel=0.02)
    assert active / 1e9 == pytest.approx(active_b, rel=0.02)
