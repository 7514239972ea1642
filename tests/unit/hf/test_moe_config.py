"""Qwen3-MoE and Mixtral config.json (as transformers writes them and as published) -> the model's
MoE fields; DeepSeek-style routing refused naming the key; the exported config.json is the same
model again for transformers."""

from __future__ import annotations

import json

import pytest

from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.hf.config import hf_config_dict, merge_hf_config, model_fields, read_hf_config
from tests.support.moe import moe_config


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_fields_and_export_round_trip(family, tmp_path):
    from transformers import AutoConfig

    src, out = tmp_path / "src", tmp_path / "out"
    moe_config(family).save_pretrained(str(src))
    m = merge_hf_config(compose([f"model.hf_path={src}"])).model
    assert m.family == family and m.num_experts == 4 and m.moe_router_topk == 2
    assert m.moe_norm_topk_prob and m.moe_aux_loss_coeff == 0.01
    if family == "qwen3_moe":
        assert (m.moe_ffn_hidden_size, m.ffn_hidden_size, m.kv_channels) == (48, 96, 32)
        assert list(m.moe_dense_layers) == [1]
    else:
        assert (m.moe_ffn_hidden_size, m.ffn_hidden_size) == (48, 48)
        assert list(m.moe_dense_layers) == []
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(m, dtype="float32")))
    back, ref = AutoConfig.from_pretrained(str(out)), AutoConfig.from_pretrained(str(src))
    assert type(back) is type(ref)
    keys = ["num_experts", "num_experts_per_tok", "intermediate_size", "router_aux_loss_coef"]
    if family == "qwen3_moe":
        keys += ["moe_intermediate_size", "norm_topk_prob", "mlp_only_layers", "head_dim"]
    for k in keys:
        assert getattr(back, k) == getattr(ref, k), k
    assert model_fields(json.loads((out / "config.json").read_text())) == model_fields(
        json.loads((src / "config.json").read_text())
    )


def test_published_qwen3_moe_spelling():
    """Qwen3-30B-A3B's config.json: num_experts, norm_topk_prob, decoder_sparse_step."""
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 6,
          "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 100, "num_experts": 8,
          "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 2,
          "mlp_only_layers": [0], "router_aux_loss_coef": 0.001}  # fmt: skip
    f = model_fields(hf)
    assert f["num_experts"] == 8 and f["moe_ffn_hidden_size"] == 16
    assert f["moe_dense_layers"] == [0, 2, 4] and f["moe_norm_topk_prob"] is False


@pytest.mark.parametrize(
    "change,key",
    [
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ({"n_shared_experts": 1}, "n_shared_experts"),
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"topk_method": "noaux_tc"}, "topk_method"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ],
)
def test_deepseek_style_routing_is_refused_by_key(tmp_path, change, key):
    moe_config("qwen3_moe").save_pretrained(str(tmp_path))
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **change}))
    with pytest.raises(FtcoreError, match=key) as e:
        read_hf_config(str(tmp_path))
    assert "model.hf_path" in str(e.value) and "fix" in str(e.value)
