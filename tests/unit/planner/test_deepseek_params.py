"""The planner's counts for DeepSeek-V3 (MLA, shared experts, the expert bias) and GLM-4.5 against
the oracle: transformers' own tiny models (tests/support/deepseek.py) counted with numel (the
expert bias is a buffer there, in the checkpoint); then the shipped presets against the published
totals (docs/deepseek.md)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ftcore.config.schema import compose
from ftcore.hf.config import merge_hf_config
from ftcore.planner.params import active_params, mtp_params, total_params
from tests.support.deepseek import EXPERTS, tiny_config


@pytest.mark.parametrize("family,q_lora", [("deepseek_v3", True), ("deepseek_v3", False),
                                           ("glm4_moe", True)])  # fmt: skip
def test_counts_equal_transformers_model(family, q_lora, tmp_path):
    hf = tiny_config(family, vocab=96, q_lora=q_lora)
    hf.save_pretrained(str(tmp_path))
    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(hf)
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    total += sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    routed = sum(p.numel() for n, p in named.items() if ".mlp.experts." in n)
    active = total - routed + routed * hf.num_experts_per_tok // EXPERTS
    cfg = merge_hf_config(compose(["+exp=tiny_full", f"model.hf_path={tmp_path}"]))
    assert (total_params(cfg), active_params(cfg)) == (total, active)


@pytest.mark.parametrize(
    "model,total_b,mtp_b,active_b,rel",
    [("deepseek_v3", 671, 685, 37, 0.02),  # 671B + 14B of MTP (DeepSeek-V3's README)
     ("kimi_k2", 1030, 1030, 32, 0.03),  # "1.04T total, 32B activated"; no MTP layer
     ("glm45", 355, None, 32, 0.01),  # GLM-4.5's card: 355B / 32B active, embeddings excluded
     ("glm45_air", 106, None, 12, 0.02)],  # 106B / 12B
)  # fmt: skip
def test_presets_match_the_published_totals(model, total_b, mtp_b, active_b, rel):
    cfg = compose([f"model={model}", "peft=none"])
    total, active, mtp = total_params(cfg), active_params(cfg), mtp_params(cfg)
    assert total / 1e9 == pytest.approx(total_b, rel=rel)
    if mtp_b is not None:
        assert (total + mtp) / 1e9 == pytest.approx(mtp_b, rel=rel)
    if model.startswith("glm"):  # GLM counts the active parameters without embedding and head
        active -= 2 * cfg.model.vocab_size * cfg.model.hidden_size
    assert active / 1e9 == pytest.approx(active_b, rel=0.05)
