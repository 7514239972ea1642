"""The mixture-of-experts part of `config.json` <-> the model's `num_experts` and `moe_*` fields.

Qwen3-MoE (softmax router, top-k renormalised when `norm_topk_prob`, dense layers where
`mlp_only_layers` / `decoder_sparse_step` say) and Mixtral (top-k then softmax over the chosen,
which is the renormalised softmax) are read; what megatron's plain router cannot reproduce
(shared experts, sigmoid scores, an expert bias or group-limited routing, a scaled router
output, jitter) is refused with the key that asks for it (docs/moe.md).
"""

from __future__ import annotations

from ftcore.errors import FtcoreError

# both spellings: published Qwen3-MoE writes num_experts, transformers 5 num_local_experts
COUNT_KEYS = ("num_experts", "num_local_experts")
MOE_KEYS = COUNT_KEYS + ("n_routed_experts", "moe_intermediate_size")
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def _refused(hf: dict) -> list[tuple[str, str]]:
    """(key, why) for every routing feature of config.json that megatron's router here lacks."""
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
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        out.append(("router_jitter_noise", "router jitter"))
    return out


def check_moe_keys(hf: dict, f, field: str, family: str | None) -> None:
    """Refuse a routing feature ftcore cannot reproduce (naming the key), or expert keys in a
    config.json whose family is dense."""
    bad = _refused(hf)
    if bad:
        keys = ", ".join(f"{k} ({why})" for k, why in bad)
        raise FtcoreError(
            f"{f}: mixture-of-experts feature not supported: {keys}",
            field=field,
            fix="ftcore maps Qwen3-MoE and Mixtral routers (softmax, top-k, no shared experts); "
            "DeepSeek-style routing waits for a later issue",
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


def moe_fields(hf: dict, family: str, num_layers: int) -> dict:
    """The model's MoE keys from config.json (dense families: num_experts None)."""
    if family not in MOE_FAMILIES:
        return {"num_experts": None, "moe_ffn_hidden_size": None, "moe_dense_layers": []}
    experts = next((int(hf[k]) for k in COUNT_KEYS if hf.get(k)), None)
    if experts is None:
        raise FtcoreError(f"{family} config.json has no num_experts", field="model.hf_path",
                          fix="restore config.json from the model's original files")  # fmt: skip
    topk = int(hf.get("num_experts_per_tok", 2))
    if topk > experts:
        raise FtcoreError(f"num_experts_per_tok={topk} > {experts} experts", field="model.hf_path",
                          fix="restore config.json from the model's original files")  # fmt: skip
    mixtral = family == "mixtral"
    return {
        "num_experts": experts,
        "moe_ffn_hidden_size": int(hf["intermediate_size" if mixtral else "moe_intermediate_size"]),
        "moe_router_topk": topk,
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
    return {
        **out,
        "num_experts": int(m.num_experts),
        "moe_intermediate_size": int(m.moe_ffn_hidden_size),
        "norm_topk_prob": bool(m.moe_norm_topk_prob),
        "mlp_only_layers": sorted(int(i) for i in m.moe_dense_layers),
        "decoder_sparse_step": 1,
    }
