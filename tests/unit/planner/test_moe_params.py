"""The planner's MoE parameter counts (params.total_params / active_params) against the oracle:
transformers' own Qwen3-MoE and Mixtral models, built tiny, counted with numel; then the shipped
big configs against their model cards' totals."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ftcore.config.schema import compose
from ftcore.planner.params import active_params, total_params
from tests.support.moe import MOE_FAMILIES, NUM_EXPERTS, TOPK, moe_config


def _hf_counts(model, top_k: int, num_experts: int) -> tuple[int, int]:
    """(every parameter, those one token passes through: top_k of each layer's experts)."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, total - experts + experts * top_k // num_experts


def _planned(overrides: list[str]):
    cfg = compose(["+exp=tiny_full", *overrides])
    return total_params(cfg), active_params(cfg)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_counts_equal_transformers_model(family):
    """tests/support/moe.py's tiny models (Qwen3-MoE with a dense layer 1, head_dim apart)."""
    hf = moe_config(family, vocab=96)
    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(hf)
    total, active = _hf_counts(model, TOPK, NUM_EXPERTS)
    overrides = [
        f"model.family={family}",
        f"model.vocab_size={hf.vocab_size}",
        f"model.hidden_size={hf.hidden_size}",
        f"model.num_layers={hf.num_hidden_layers}",
        f"model.num_attention_heads={hf.num_attention_heads}",
        f"model.num_query_groups={hf.num_key_value_heads}",
        f"model.kv_channels={getattr(hf, 'head_dim', None) or 'null'}",
        f"model.ffn_hidden_size={hf.intermediate_size}",
        f"model.moe_ffn_hidden_size={getattr(hf, 'moe_intermediate_size', hf.intermediate_size)}",
        f"model.moe_dense_layers={list(getattr(hf, 'mlp_only_layers', []))}",
        f"model.num_experts={NUM_EXPERTS}",
        f"model.moe_router_topk={TOPK}",
        "model.tie_embeddings=false",
    ]
    assert _planned(overrides) == (total, active)


@pytest.mark.parametrize(
    "model, total_b, active_b",
    [("qwen3_30b_a3b", 30.5, 3.3), ("qwen3_235b_a22b", 235, 22), ("mixtral_8x22b", 141, 39)],
)
def test_shipped_configs_match_the_model_cards(model, total_b, active_b):
    """The cards round: within 2% of their totals (Qwen3-30B-A3B's 3.35 B active is "3.3B")."""
    total, active = _planned([f"model={model}"])
    assert total / 1e9 == pytest.approx(total_b, rel=0.02)
    assert active / 1e9 == pytest.approx(active_b, rel=0.02)


def test_plan_reads_the_shapes_of_model_hf_path(tmp_path, capsys):
    """`ftcore.plan model.hf_path=DIR` plans the checkpoint's own shapes (a MoE one here), not the
    preset's: the total is transformers' count of the saved model."""
    import json

    from ftcore.cli import main
    from ftcore.plan import task
    from tests.support.moe import make_tiny_moe

    path = make_tiny_moe(tmp_path / "moe", "qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(path)
    status = main("plan", task, ["+exp=tiny_full", f"model.hf_path={path}", "plan.format=json",
                                 "cluster.host_probe=false"])  # fmt: skip
    assert status == 0
    params = json.loads(capsys.readouterr().out)["params"]
    assert params["total"] == sum(p.numel() for p in model.parameters())
    assert params["moe"]["experts"] == NUM_EXPERTS
