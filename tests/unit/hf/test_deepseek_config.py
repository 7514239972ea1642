"""DeepSeek-V3 (Kimi-K2) and GLM-4.5 config.json as published -> the model's fields; what
megatron would compute otherwise refused naming the key; the exported config.json is the same
model again for transformers (docs/deepseek.md)."""

from __future__ import annotations

import json

import pytest

from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.hf.config import hf_config_dict, merge_hf_config, model_fields, read_hf_config
from tests.support.deepseek import tiny_config

# the published config.json values (huggingface.co/<repo>/config.json), the keys ftcore reads
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_theta": 10000, "num_nextn_predict_layers": 1, "attention_bias": False, "ep_size": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
}  # fmt: skip
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
           "num_key_value_heads": 64, "n_routed_experts": 384, "routed_scaling_factor": 2.827,
           "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "rope_theta": 50000.0,
           "num_nextn_predict_layers": 0, "max_position_embeddings": 131072,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                            "type": "yarn"}}  # fmt: skip
GLM45 = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552,
    "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": True,
    "n_shared_experts": 1, "n_routed_experts": 160, "routed_scaling_factor": 2.5, "n_group": 1,
    "topk_group": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "hidden_act": "silu",
}  # fmt: skip
GLM45_AIR = {**GLM45, "hidden_size": 4096, "intermediate_size": 10944,
             "moe_intermediate_size": 1408, "num_hidden_layers": 46, "n_routed_experts": 128,
             "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "use_qk_norm": False}  # fmt: skip


def test_published_deepseek_v3_and_kimi_k2():
    f = model_fields(DEEPSEEK_V3)
    assert f["family"] == "deepseek_v3" and f["num_experts"] == 256 and f["moe_router_topk"] == 8
    assert (f["moe_router_num_groups"], f["moe_router_group_topk"]) == (8, 4)
    assert f["moe_router_topk_scaling_factor"] == 2.5 and f["moe_dense_layers"] == [0, 1, 2]
    assert f["moe_shared_expert_ffn_hidden_size"] == 2048 and f["moe_router_expert_bias"]
    assert (f["q_lora_rank"], f["kv_lora_rank"], f["qk_rope_head_dim"]) == (1536, 512, 64)
    assert f["kv_channels"] == 192 and f["num_query_groups"] == 128 and f["mtp_layers"] == 1
    assert f["rope_scaling"] == {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 4096}  # fmt: skip
    k = model_fields(KIMI_K2)  # DeepseekV3ForCausalLM's architecture, its own values
    assert k["family"] == "deepseek_v3" and k["num_experts"] == 384 and k["mtp_layers"] == 0
    assert k["moe_router_num_groups"] is None and k["moe_dense_layers"] == [0]


def test_published_glm45_and_air():
    for hf, norm, dense in ((GLM45, True, [0, 1, 2]), (GLM45_AIR, False, [0])):
        f = model_fields(hf)
        assert f["family"] == "glm4_moe" and f["qkv_bias"] and f["qk_layernorm"] is norm
        assert f["rotary_percent"] == 0.5 and f["kv_channels"] == 128
        assert f["moe_dense_layers"] == dense and f["moe_router_expert_bias"]
        assert f["q_lora_rank"] is None and f["mtp_layers"] == 1


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_export_round_trip(family, tmp_path):
    """transformers' own config of the tiny models -> cfg.model -> config.json: transformers reads
    the same model, and ftcore the same fields."""
    from transformers import AutoConfig

    src, out = tmp_path / "src", tmp_path / "out"
    tiny_config(family).save_pretrained(str(src))
    m = merge_hf_config(compose([f"model.hf_path={src}"])).model
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(m, dtype="float32")))
    back, ref = AutoConfig.from_pretrained(str(out)), AutoConfig.from_pretrained(str(src))
    assert type(back) is type(ref)
    keys = ["n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
            "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
            "norm_topk_prob", "intermediate_size", "num_attention_heads", "head_dim"]  # fmt: skip
    keys += (["q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "rope_interleave", "rope_parameters"] if family == "deepseek_v3"
             else ["attention_bias", "use_qk_norm", "rope_parameters", "num_key_value_heads"])  # fmt: skip
    for k in keys:
        assert getattr(back, k) == getattr(ref, k), k
    assert model_fields(json.loads((out / "config.json").read_text())) == model_fields(
        json.loads((src / "config.json").read_text())
    )


@pytest.mark.parametrize(
    "base,change,key",
    [
        (DEEPSEEK_V3, {"scoring_func": "softmax"}, "scoring_func"),
        (DEEPSEEK_V3, {"topk_method": "greedy"}, "topk_method"),
        (DEEPSEEK_V3, {"norm_topk_prob": False}, "norm_topk_prob"),
        (DEEPSEEK_V3, {"topk_group": 2}, "topk_group"),  # 8 / 2 = 4 experts per group's score
        (DEEPSEEK_V3, {"moe_layer_freq": 2}, "moe_layer_freq"),
        (DEEPSEEK_V3, {"rope_interleave": False}, "rope_interleave"),
        (DEEPSEEK_V3, {"attention_bias": True}, "attention_bias"),
        (DEEPSEEK_V3, {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        (DEEPSEEK_V3, {"rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "attention_factor": 1.2}},
         "attention_factor"),
        (DEEPSEEK_V3, {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type=linear"),
        (GLM45, {"rope_scaling": {"type": "yarn", "factor": 2.0,
                                  "original_max_position_embeddings": 4096}}, "rope_type=yarn"),
        (GLM45, {"scoring_func": "softmax"}, "scoring_func"),
    ],
)  # fmt: skip
def test_unsupported_is_refused_by_key(tmp_path, base, change, key):
    (tmp_path / "config.json").write_text(json.dumps({**base, **change}))
    with pytest.raises(FtcoreError, match=key) as e:
        read_hf_config(str(tmp_path))
    assert "model.hf_path" in str(e.value) and "fix" in str(e.value)


def test_checks_refuse_what_transformers_cannot_hold(tmp_path):
    """Set by hand (no hf_path): what the family's HF class could not express is refused."""
    from ftcore.validation.moe_checks import check_biased_router

    tiny_config("deepseek_v3").save_pretrained(str(tmp_path))
    cfg = merge_hf_config(compose([f"model.hf_path={tmp_path}"]))
    check_biased_router(cfg)
    for over, field in (({"moe_dense_layers": [1]}, "moe_dense_layers"),
                        ({"moe_router_group_topk": 1}, "moe_router_num_groups"),
                        ({"moe_router_score_function": "softmax"}, "moe_router_score_function"),
                        ({"moe_shared_expert_ffn_hidden_size": 40}, "moe_shared_expert")):  # fmt: skip
        bad = cfg.copy()
        for k, v in over.items():
            bad.model[k] = v
        with pytest.raises(FtcoreError, match=field):
            check_biased_router(bad)
    plain = compose(["model.num_experts=4", "model.family=qwen3_moe", "model.moe_ffn_hidden_size=8",
                     "moe.expert_bias_update_rate=0.01"])  # fmt: skip
    with pytest.raises(FtcoreError, match="expert_bias_update_rate"):
        check_biased_router(plain)
