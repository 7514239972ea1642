"""The mixture-of-experts part of `config.json` <-> the model's `num_experts` and `moe_*` fields.

Qwen3-MoE (softmax router, top-k renormalised when `norm_topk_prob`, dense layers where
`mlp_only_layers` / `decoder_sparse_step` say) and Mixtral (top-k then softmax over the chosen,
which is the renormalised softmax) take megatron's plain router; a shared expert, sigmoid scores,
an expert bias, group-limited routing, a scaled router output or jitter in their config.json is
refused with the key that asks for it (docs/moe.md).

DeepSeek-V3 (Kimi-K2) and GLM-4.5 take megatron's DeepSeek router (docs/deepseek.md): sigmoid
scores, `e_score_correction_bias` added for the choice only, experts chosen within the best
`topk_group` of `n_group` groups, the chosen scores renormalised and scaled by
`routed_scaling_factor`, shared experts of `n_shared_experts x moe_intermediate_size`, dense first
`first_k_dense_replace` layers. transformers' classes compute exactly that whatever
`scoring_func`/`topk_method` say, so another value there is refused rather than guessed; so is a
router megatron computes otherwise (below).
"""

from __future__ import annotations

from ftcore.errors import FtcoreError

# both spellings: published Qwen3-MoE writes num_experts, transformers 5 num_local_experts
COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
MOE_KEYS = COUNT_KEYS + ("moe_intermediate_size",)
MOE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe")
BIASED = ("deepseek_v3", "glm4_moe")  # DeepSeek-V3's router: sigmoid, expert bias, groups
# transformers' defaults where config.json leaves a key out (DeepseekV3Config, Glm4MoeConfig)
HF_DEFAULTS = {
    "deepseek_v3": {"n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048,
                    "num_experts_per_tok": 8, "routed_scaling_factor": 2.5, "n_group": 8,
                    "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                    "qk_nope_head_dim": 128, "v_head_dim": 128, "rope_interleave": True,
                    "attention_bias": False},
    "glm4_moe": {"n_routed_experts": 128, "n_shared_experts": 1, "moe_intermediate_size": 1408,
                 "num_experts_per_tok": 8, "routed_scaling_factor": 1.0, "n_group": 1,
                 "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
                 "use_qk_norm": False, "attention_bias": False, "partial_rotary_factor": 0.5},
}  # fmt: skip


def value(hf: dict, family: str | None, key: str):
    """config.json's `key`, else transformers' default for the family (None if it has none)."""
    return hf[key] if key in hf else HF_DEFAULTS.get(family or "", {}).get(key)


def _groups(hf: dict, family: str) -> tuple[int, int]:
    return int(value(hf, family, "n_group") or 1), int(value(hf, family, "topk_group") or 1)


def _refused_plain(hf: dict) -> list[tuple[str, str]]:
    """(key, why) for every routing feature of a Qwen3-MoE/Mixtral config.json megatron's plain
    router here lacks."""
    out = []
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
                "moe_shared_expert_intermediate_size"):  # fmt: skip
        if hf.get(key):
            out.append((key, "shared experts"))
    if hf.get("scoring_func", "softmax") != "softmax":
        out.append(("scoring_func", f"a {hf['scoring_func']} router"))
    if hf.get("topk_method") not in (None, "greedy"):
        out.append(("topk_method", f"{hf['topk_method']} routing (expert bias or groups)"))
    if "e_score_correction_bias" in hf or hf.get("moe_router_enable_expert_bias"):
        out.append(("e_score_correction_bias", "an expert bias"))
    if (hf.get("n_group") or 1) > 1 or (hf.get("topk_group") or 1) > 1:
        out.append(("n_group", "group-limited routing"))
    if float(hf.get("routed_scaling_factor") or 1.0) != 1.0:
        out.append(("routed_scaling_factor", "a scaled router output"))
    return out


def _refused_biased(hf: dict, family: str) -> list[tuple[str, str]]:
    """(key, why) for what megatron's DeepSeek router would compute otherwise than transformers."""
    out = []
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        out.append(("scoring_func", f"{hf['scoring_func']}: transformers' {family} router scores "
                    "with a sigmoid whatever this says"))  # fmt: skip
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        out.append(("topk_method", f"{hf['topk_method']}: transformers' {family} router is "
                    "noaux_tc (expert bias, groups) whatever this says"))  # fmt: skip
    topk = int(value(hf, family, "num_experts_per_tok"))
    if topk > 1 and not value(hf, family, "norm_topk_prob"):
        out.append(("norm_topk_prob", "false: megatron's sigmoid router always renormalises the "
                    "top k it picks"))  # fmt: skip
    groups, pick = _groups(hf, family)
    experts = int(value(hf, family, "n_routed_experts"))
    if groups > 1 and experts % groups:
        out.append(("n_group", f"{groups} does not divide n_routed_experts={experts}"))
    elif 1 < groups and pick < groups and topk // pick != 2:
        out.append(("topk_group", f"{pick} with num_experts_per_tok={topk}: transformers scores a "
                    "group by its best 2 experts, megatron by its best num_experts_per_tok / "
                    f"topk_group = {topk // pick}"))  # fmt: skip
    if int(hf.get("moe_layer_freq") or 1) != 1:
        out.append(("moe_layer_freq", f"{hf['moe_layer_freq']}: transformers makes every layer "
                    "from first_k_dense_replace on a MoE layer"))  # fmt: skip
    return out


def _refused(hf: dict, family: str | None) -> list[tuple[str, str]]:
    out = _refused_biased(hf, family) if family in BIASED else _refused_plain(hf)
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        out.append(("router_jitter_noise", "router jitter"))
    return out


def check_moe_keys(hf: dict, f, field: str, family: str | None) -> None:
    """Refuse a routing feature ftcore cannot reproduce (naming the key), or expert keys in a
    config.json whose family is dense."""
    bad = _refused(hf, family)
    if bad:
        keys = ", ".join(f"{k} ({why})" for k, why in bad)
        raise FtcoreError(
            f"{f}: mixture-of-experts feature not supported: {keys}",
            field=field,
            fix="ftcore maps Qwen3-MoE and Mixtral routers (softmax, top-k, no shared experts) "
            "and DeepSeek-V3/GLM-4.5 routers as transformers computes them (docs/deepseek.md)",
        )
    moe = [k for k in MOE_KEYS if hf.get(k)]
    if moe and family not in MOE_FAMILIES:
        raise FtcoreError(
            f"{f}: {moe[0]} in a {family or 'non-ftcore'} config.json (mixture of experts is not "
            "supported for this architecture)",
            field=field,
            fix=f"use a dense checkpoint or one of the MoE families: {', '.join(MOE_FAMILIES)}",
        )


def dense_layers(hf: dict, num_layers: int) -> list[int]:
    """Qwen3-MoE's dense layers as transformers decides them: in mlp_only_layers, or not a
    multiple of decoder_sparse_step (counting from 1)."""
    only = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step") or 1)
    return [i for i in range(num_layers) if i in only or (i + 1) % step != 0]


def _biased_fields(hf: dict, family: str, num_layers: int) -> dict:
    """DeepSeek-V3 / GLM-4.5: transformers' router as megatron's switches."""
    moe_ffn = int(value(hf, family, "moe_intermediate_size"))
    shared = int(value(hf, family, "n_shared_experts") or 0)
    groups, pick = _groups(hf, family)
    grouped = groups > 1 and pick < groups  # all groups picked: the plain top k
    first = min(int(value(hf, family, "first_k_dense_replace") or 0), num_layers)
    return {
        "num_experts": int(value(hf, family, "n_routed_experts")),
        "moe_ffn_hidden_size": moe_ffn,
        "moe_router_topk": int(value(hf, family, "num_experts_per_tok")),
        "moe_norm_topk_prob": True,  # _refused_biased: the only kind megatron computes
        "moe_dense_layers": list(range(first)),
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0)),
        "moe_shared_expert_ffn_hidden_size": shared * moe_ffn if shared else None,
        "moe_router_score_function": "sigmoid",
        "moe_router_expert_bias": True,
        "moe_router_num_groups": groups if grouped else None,
        "moe_router_group_topk": pick if grouped else None,
        "moe_router_topk_scaling_factor": float(value(hf, family, "routed_scaling_factor") or 1.0),
    }


def moe_fields(hf: dict, family: str, num_layers: int) -> dict:
    """The model's MoE keys from config.json (dense families: num_experts None)."""
    plain = {"moe_shared_expert_ffn_hidden_size": None, "moe_router_score_function": "softmax",
             "moe_router_expert_bias": False, "moe_router_num_groups": None,
             "moe_router_group_topk": None, "moe_router_topk_scaling_factor": 1.0}  # fmt: skip
    if family not in MOE_FAMILIES:
        return {"num_experts": None, "moe_ffn_hidden_size": None, "moe_dense_layers": [], **plain}
    if family in BIASED:
        out = _biased_fields(hf, family, num_layers)
    else:
        out = {**plain, **_plain_fields(hf, family, num_layers)}
    if out["moe_router_topk"] > out["num_experts"]:
        raise FtcoreError(f"num_experts_per_tok={out['moe_router_topk']} > {out['num_experts']} "
                          "experts", field="model.hf_path",
                          fix="restore config.json from the model's original files")  # fmt: skip
    return out


def _plain_fields(hf: dict, family: str, num_layers: int) -> dict:
    experts = next((int(hf[k]) for k in COUNT_KEYS if hf.get(k)), None)
    if experts is None:
        raise FtcoreError(f"{family} config.json has no num_experts", field="model.hf_path",
                          fix="restore config.json from the model's original files")  # fmt: skip
    mixtral = family == "mixtral"
    return {
        "num_experts": experts,
        "moe_ffn_hidden_size": int(hf["intermediate_size" if mixtral else "moe_intermediate_size"]),
        "moe_router_topk": int(hf.get("num_experts_per_tok", 2)),
        "moe_norm_topk_prob": True if mixtral else bool(hf.get("norm_topk_prob", False)),
        "moe_dense_layers": [] if mixtral else dense_layers(hf, num_layers),
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0)),
    }


def moe_export_keys(m) -> dict:
    """config.json keys that make transformers build the same MoE model (published spellings)."""
    if m.get("family") not in MOE_FAMILIES or not m.get("num_experts"):
        return {}
    out = {
        "num_experts_per_tok": int(m.moe_router_topk),
        "router_aux_loss_coef": float(m.moe_aux_loss_coeff),
        "output_router_logits": False,
    }
    if m.family == "mixtral":
        return {**out, "num_local_experts": int(m.num_experts), "router_jitter_noise": 0.0}
    if m.family in BIASED:
        shared = m.get("moe_shared_expert_ffn_hidden_size") or 0
        groups = m.get("moe_router_num_groups")
        out.pop("router_aux_loss_coef")  # neither class has one
        return {
            **out,
            "n_routed_experts": int(m.num_experts),
            "moe_intermediate_size": int(m.moe_ffn_hidden_size),
            "n_shared_experts": int(shared) // int(m.moe_ffn_hidden_size),
            "routed_scaling_factor": float(m.moe_router_topk_scaling_factor),
            "n_group": int(groups or 1),
            "topk_group": int(m.get("moe_router_group_topk") or 1),
            "norm_topk_prob": True,
            "first_k_dense_replace": len(m.moe_dense_layers),
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
        }
    return {
        **out,
        "num_experts": int(m.num_experts),
        "moe_intermediate_size": int(m.moe_ffn_hidden_size),
        "norm_topk_prob": bool(m.moe_norm_topk_prob),
        "mlp_only_layers": sorted(int(i) for i in m.moe_dense_layers),
        "decoder_sparse_step": 1,
    }
