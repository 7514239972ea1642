"""Mixture-of-experts settings that cannot work, refused before anything is built (docs/moe.md).

The rules are megatron-core 0.16.1's (its parallel state, TransformerConfig and MoE layer) and
the CPU runtime's (gloo), checked here so that a run exits 2 with the fix instead of failing at
the first forward: experts divide by ep; ep·etp·pp divides the world (megatron's expert grid);
etp > 1 only on GPU (the dispatcher's all_gather with uneven splits, which gloo lacks); training
at tp > 1 only with sequence parallelism (megatron's MoE layer raises otherwise); ep/etp and the
`moe` section only on a MoE model; FP8/FP4 experts only in Transformer Engine layers.
"""

from __future__ import annotations

from omegaconf import DictConfig

from ftcore.config.families import family
from ftcore.errors import FtcoreError
from ftcore.hf.moe_config import BIASED, MOE_FAMILIES

DISPATCHERS = ("alltoall",)  # the one ftcore tests (megatron's allgather/flex are not)
ROUTER_DTYPES = ("fp32", "fp64")


def _no(what: str, field: str, fix: str) -> None:
    raise FtcoreError(what, field=field, fix=fix)


def check_attention(cfg: DictConfig) -> None:
    """Multi-head latent attention's shapes (family deepseek_v3) and the rotary settings a family
    supports: YaRN is megatron's MLA only, a partial rotary standard attention only."""
    m, tp = cfg.model, int(cfg.parallel.tp)
    r = m.get("rope_scaling")
    yarn = r is not None and r.get("rope_type", "llama3") == "yarn"
    if not family(m).mla:
        if yarn:
            _no(f"model.rope_scaling.rope_type=yarn on family {m.family}: ftcore applies YaRN in "
                "megatron's latent attention only (DeepSeek-V3)", "model.rope_scaling.rope_type",
                "rope_type llama3, or no rope_scaling")  # fmt: skip
        return
    missing = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
               if not m.get(k)]  # fmt: skip
    if missing:
        _no(f"model.family={m.family} is multi-head latent attention but model.{missing[0]} is "
            "not set", f"model.{missing[0]}", "set the MLA shapes (model.hf_path reads them)")  # fmt: skip
    if float(m.get("rotary_percent") or 1.0) != 1.0:
        _no("model.rotary_percent with latent attention: its rotary part is qk_rope_head_dim",
            "model.rotary_percent", "model.rotary_percent=1.0")  # fmt: skip
    widths = {"model.q_lora_rank": m.get("q_lora_rank") or 0,
              "model.kv_lora_rank": int(m.kv_lora_rank) + int(m.qk_rope_head_dim)}  # fmt: skip
    for field, width in widths.items():  # the local spec's down projections are column-parallel
        if width % tp:
            _no(f"parallel.tp={tp} does not divide {field.split('.')[1]}"
                f"{' + qk_rope_head_dim' if 'kv' in field else ''} = {width}", "parallel.tp",
                "a tp dividing the latent widths")  # fmt: skip


def check_biased_router(cfg: DictConfig) -> None:
    """DeepSeek-V3/GLM-4.5 routing where transformers' class can express it (export writes its
    config.json), and the plain families without it (docs/deepseek.md)."""
    m, moe = cfg.model, cfg.get("moe") or {}
    experts, biased = m.get("num_experts"), m.get("family") in BIASED
    if float(moe.get("expert_bias_update_rate") or 0.0) > 0 and not m.get("moe_router_expert_bias"):
        _no("moe.expert_bias_update_rate > 0 on a router without an expert bias",
            "moe.expert_bias_update_rate", "0 (or a DeepSeek-V3 / GLM-4.5 model)")  # fmt: skip
    if not experts:
        return
    sigmoid = m.get("moe_router_score_function", "softmax") == "sigmoid"
    extras = {"model.moe_shared_expert_ffn_hidden_size": m.get("moe_shared_expert_ffn_hidden_size"),
              "model.moe_router_num_groups": m.get("moe_router_num_groups"),
              "model.moe_router_expert_bias": m.get("moe_router_expert_bias"),
              "model.moe_router_topk_scaling_factor":
              float(m.get("moe_router_topk_scaling_factor") or 1.0) != 1.0}  # fmt: skip
    if not biased:
        on = [k for k, v in extras.items() if v] + (
            ["model.moe_router_score_function"] if sigmoid else []
        )
        if on:
            _no(f"{on[0]} on family {m.family}: transformers' {m.family} router has no shared "
                "experts, sigmoid scores, expert bias, groups or scaling", on[0],
                "family deepseek_v3 or glm4_moe, or leave it unset")  # fmt: skip
        return
    if not sigmoid or not m.get("moe_router_expert_bias") or not m.get("moe_norm_topk_prob", True):
        _no(f"family {m.family} routes with sigmoid scores, an expert bias and renormalised top k "
            "(transformers' class, whatever else is set)", "model.moe_router_score_function",
            "model.moe_router_score_function=sigmoid model.moe_router_expert_bias=true "
            "model.moe_norm_topk_prob=true")  # fmt: skip
    dense = sorted(int(i) for i in m.get("moe_dense_layers") or [])
    if dense != list(range(len(dense))):
        _no(f"moe_dense_layers {dense}: {m.family} has dense layers first only "
            "(first_k_dense_replace)", "model.moe_dense_layers", f"[0 .. k-1], e.g. {list(range(len(dense)))}")  # fmt: skip
    shared, ffn = m.get("moe_shared_expert_ffn_hidden_size") or 0, int(m.moe_ffn_hidden_size)
    if shared % ffn:
        _no(f"moe_shared_expert_ffn_hidden_size={shared} is not a whole number of experts of "
            f"{ffn}", "model.moe_shared_expert_ffn_hidden_size", f"a multiple of {ffn}")  # fmt: skip
    groups, pick = m.get("moe_router_num_groups"), m.get("moe_router_group_topk")
    if groups or pick:
        if (
            not (groups and pick)
            or experts % groups
            or pick >= groups
            or m.moe_router_topk // pick != 2
        ):
            _no(f"moe_router_num_groups={groups}, moe_router_group_topk={pick}: transformers' "
                f"router picks the best topk_group < n_group groups dividing the {experts} "
                "experts, each scored by its best 2 (megatron: by its best topk / topk_group)",
                "model.moe_router_num_groups", "both null, or n_group | experts and "
                "topk_group = moe_router_topk / 2 < n_group")  # fmt: skip


def check_moe(cfg: DictConfig, world: int | None, *, training: bool) -> None:
    check_attention(cfg)
    check_biased_router(cfg)
    m, p = cfg.model, cfg.parallel
    ep, etp = int(p.get("ep", 1)), int(p.get("etp", 1))
    experts = m.get("num_experts")
    moe = cfg.get("moe") or {}
    if not experts:
        if m.get("family") in MOE_FAMILIES:
            _no(f"model.family={m.family} is a mixture of experts but model.num_experts is not set",
                "model.num_experts", "set model.num_experts (model.hf_path reads it from config.json)")  # fmt: skip
        if ep > 1 or etp > 1:
            _no(f"parallel.ep={ep}, parallel.etp={etp}: expert parallelism needs a mixture-of-experts "
                f"model, and {m.get('name', 'this model')} is dense", "parallel.ep",
                "set parallel.ep=1 parallel.etp=1 (split a dense model with tp, pp, cp or dp)")  # fmt: skip
        return
    if m.get("family") not in MOE_FAMILIES:
        _no(f"model.num_experts={experts} on family {m.get('family')}, which has no experts (its "
            "Hugging Face model could not hold them)", "model.num_experts",
            f"use a MoE family ({', '.join(MOE_FAMILIES)}) or model.num_experts=null")  # fmt: skip
    if m.moe_router_topk > experts:
        _no(f"moe_router_topk={m.moe_router_topk} > num_experts={experts}", "model.moe_router_topk",
            f"model.moe_router_topk<={experts}")  # fmt: skip
    bad = [i for i in m.get("moe_dense_layers") or [] if i >= m.num_layers]
    if bad:
        _no(f"moe_dense_layers {bad} are not layers of a {m.num_layers}-layer model",
            "model.moe_dense_layers", f"indices below {m.num_layers}")  # fmt: skip
    if m.family == "mixtral" and (m.get("moe_dense_layers") or []):
        _no("Mixtral has no dense layers (transformers' MixtralForCausalLM could not hold them)",
            "model.moe_dense_layers", "model.moe_dense_layers=[] (or family qwen3_moe)")  # fmt: skip
    if m.family == "mixtral" and not m.get("moe_norm_topk_prob", True):
        _no("Mixtral's router always renormalises its top k (softmax over the chosen logits)",
            "model.moe_norm_topk_prob", "model.moe_norm_topk_prob=true (or family qwen3_moe)")  # fmt: skip
    if experts % ep:
        ok = [d for d in range(1, experts + 1) if experts % d == 0]
        _no(f"parallel.ep={ep} does not divide num_experts={experts}", "parallel.ep",
            f"parallel.ep={' or '.join(map(str, ok))}")  # fmt: skip
    ffn = int(m.get("moe_ffn_hidden_size") or m.ffn_hidden_size)
    if ffn % etp:
        _no(f"parallel.etp={etp} does not divide moe_ffn_hidden_size={ffn}", "parallel.etp",
            "an etp dividing the expert width (1: experts whole on each rank)")  # fmt: skip
    if world is not None and world % (ep * etp * p.pp):
        _no(f"megatron lays experts out as etp x ep x expert-dp x pp: ep*etp*pp = {ep}*{etp}*{p.pp} "
            f"= {ep * etp * p.pp} must divide the world size {world}", "parallel.ep",
            f"launcher.nproc_per_node={ep * etp * p.pp} (ftcore starts that many workers; under "
            f"torchrun/srun launch a multiple of {ep * etp * p.pp} processes), or lower "
            "parallel.ep/parallel.etp")  # fmt: skip
    if etp > 1 and cfg.cluster.device == "cpu":
        _no(f"parallel.etp={etp} on the CPU: megatron's dispatcher then all-gathers uneven token "
            "counts over the expert TP group, which gloo cannot do", "parallel.etp",
            "parallel.etp=1 on CPU (etp > 1 runs on GPU clusters)")  # fmt: skip
    if training and p.tp > 1 and not p.sp:
        _no(f"training a mixture of experts at parallel.tp={p.tp} needs sequence parallelism "
            "(megatron's MoE layer refuses it otherwise)", "parallel.sp",
            "parallel.sp=true (or parallel.tp=1)")  # fmt: skip
    prec = cfg.precision
    if (prec.get("fp8_recipe") or prec.get("fp4_recipe")) and not prec.get("te_layers", True):
        _no("FP8/FP4 experts run only in Transformer Engine's grouped layers", "precision.te_layers",
            "precision.te_layers=true (or precision=bf16)")  # fmt: skip
    if moe.get("dispatcher", "alltoall") not in DISPATCHERS:
        _no(f"moe.dispatcher={moe.dispatcher}: ftcore runs megatron's all-to-all dispatcher",
            "moe.dispatcher", "moe.dispatcher=alltoall")  # fmt: skip
    if moe.get("router_dtype", "fp32") not in ROUTER_DTYPES:
        _no(f"moe.router_dtype={moe.router_dtype} is not one of {', '.join(ROUTER_DTYPES)}",
            "moe.router_dtype", "moe.router_dtype=fp32")  # fmt: skip
