"""Mixture of experts: the model's `num_experts`/`moe_*` fields and the `moe` section ->
megatron-core's MoE switches, and the per-layer spec (an MoE MLP on sparse layers, the dense MLP
on `model.moe_dense_layers`). docs/moe.md.

Routing as transformers does it: Qwen3-MoE takes the softmax over all experts, then the top k,
renormalised when `norm_topk_prob`; Mixtral the top k, then the softmax over those (the same
renormalised numbers). megatron's router with `moe_router_pre_softmax=False` is the latter (the
top k of the logits are the top k of the softmax), with True the former without renormalising.
Experts: SequentialMLP (one megatron MLP per local expert) on CPU (and wherever megatron's local
layers are built: QLoRA, precision.te_layers=false, the dry build without TE), TEGroupedMLP and
TE's fused permutation on GPU with TE, as Megatron-Bridge's Qwen3-MoE recipes run them. With LoRA
on the experts, the GPU keeps megatron's TE spec (TE attention, TE linears, TE's permutation) with
SequentialMLP experts of TE linears, one module per expert, which ftcore's expert LoRA wraps: a
grouped GEMM holds every expert's weight in one module.
"""

from __future__ import annotations

import copy

from omegaconf import DictConfig


def is_moe(m) -> bool:
    return bool(m.get("num_experts"))


# peft.target_modules naming the experts' linears (peft/config.py SLICES: linear_fc1, linear_fc2)
EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj", "linear_fc1", "linear_fc2")


def expert_adapters(cfg: DictConfig) -> bool:
    """LoRA on the experts' linears: they are built one module per expert (SequentialMLP)."""
    peft = cfg.get("peft") or {}
    targets = {str(t) for t in peft.get("target_modules") or ()}
    return (
        is_moe(cfg.model)
        and peft.get("name", "none") != "none"
        and bool(targets & set(EXPERT_TARGETS))
    )


def layer_pattern(m) -> list[int]:
    """megatron's moe_layer_freq as a list: 1 = MoE layer, 0 = dense."""
    dense = {int(i) for i in m.get("moe_dense_layers") or []}
    return [0 if i in dense else 1 for i in range(m.num_layers)]


def aux_loss_coeff(cfg: DictConfig) -> float:
    """moe.aux_loss_coeff, else the model's (HF router_aux_loss_coef)."""
    c = cfg.get("moe", {}).get("aux_loss_coeff")
    return float(cfg.model.moe_aux_loss_coeff if c is None else c)


def transformer_kwargs(cfg: DictConfig, *, on_cpu: bool) -> dict:
    """TransformerConfig keys of an MoE model (empty for a dense one)."""
    m, p = cfg.model, cfg.parallel
    if not is_moe(m):
        return {}
    moe = cfg.get("moe") or {}
    from ftcore.precision import recipes

    te = not on_cpu and recipes.use_te(cfg)
    grouped = te and not expert_adapters(cfg)  # TEGroupedMLP
    return dict(
        num_moe_experts=int(m.num_experts),
        moe_ffn_hidden_size=int(m.moe_ffn_hidden_size or m.ffn_hidden_size),
        moe_router_topk=int(m.moe_router_topk),
        moe_router_score_function=m.get("moe_router_score_function") or "softmax",
        moe_router_pre_softmax=not m.moe_norm_topk_prob,
        **biased_router_kwargs(cfg),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=aux_loss_coeff(cfg),
        moe_z_loss_coeff=moe.get("z_loss_coeff"),
        moe_router_dtype=moe.get("router_dtype", "fp32"),
        moe_token_dispatcher_type=moe.get("dispatcher", "alltoall"),
        moe_expert_capacity_factor=moe.get("capacity_factor"),
        moe_token_drop_policy="probs",
        moe_layer_freq=layer_pattern(m),
        moe_grouped_gemm=grouped,
        moe_permute_fusion=te,  # TE's fused permutation, grouped experts or not
        # FP8/FP4 expert GEMMs take a multiple of 16 rows per expert (32 for MXFP8/FP4): the
        # dispatcher pads the routing map to it (zero-probability pairs, no change to the output),
        # so TE's grouped experts find nothing to pad and unpad in every layer (its Fp8Padding
        # returns aligned input as it is: TE 2.9, pytorch/module/fp8_padding.py)
        moe_router_padding_for_quantization=te and recipes.is_quantized(cfg),
        expert_model_parallel_size=p.get("ep", 1),
        expert_tensor_parallel_size=p.get("etp", 1),
    )


def biased_router_kwargs(cfg: DictConfig) -> dict:
    """DeepSeek-V3/GLM-4.5 routing (docs/deepseek.md): shared experts, the expert bias and its
    update rate (moe.expert_bias_update_rate; 0 keeps it), groups, the scaled output."""
    m = cfg.model
    scale = float(m.get("moe_router_topk_scaling_factor") or 1.0)
    return dict(
        moe_shared_expert_intermediate_size=m.get("moe_shared_expert_ffn_hidden_size"),
        moe_router_enable_expert_bias=bool(m.get("moe_router_expert_bias")),
        moe_router_bias_update_rate=float(
            (cfg.get("moe") or {}).get("expert_bias_update_rate") or 0.0
        ),  # fmt: skip
        moe_router_num_groups=m.get("moe_router_num_groups"),
        moe_router_group_topk=m.get("moe_router_group_topk"),
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
    )


def router_without_te() -> None:
    """megatron-core 0.16.1's moe_utils binds `te_general_gemm` only when Transformer Engine
    imports, and `RouterGatingLinearFunction.forward` tests `te_general_gemm is not None`: a
    NameError at the first router forward wherever TE is missing (a GPU without TE too, where the
    CPU runtime's fixes, runtime/cpu_moe.py, are not installed). Bound to None, megatron's own
    "no TE" value (extensions/transformer_engine.py). Idempotent; called for every MoE build."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_layer_spec(cfg: DictConfig, dense_spec, *, on_cpu: bool):
    """An MoE layer's spec. CPU: the local dense spec with megatron's MoE layer (SequentialMLP
    experts) as its MLP; GPU: megatron's TE spec with TEGroupedMLP experts, or SequentialMLP
    experts of TE linears under expert LoRA (its pre-MLP norm is a TENorm of its own, not fused
    into the first linear as in the dense TE layer)."""
    from ftcore.config.families import family

    router_without_te()

    if not on_cpu:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=int(cfg.model.num_experts), moe_grouped_gemm=not expert_adapters(cfg),
            **family(cfg.model).spec_flags,
        )  # fmt: skip
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = copy.copy(dense_spec)
    spec.submodules = copy.copy(dense_spec.submodules)
    spec.submodules.mlp = get_moe_module_spec(
        use_te=False, num_experts=int(cfg.model.num_experts), moe_grouped_gemm=False
    )
    return spec


def layer_specs(cfg: DictConfig, dense_spec, moe_spec, *, first: int, n: int) -> list:
    """The specs of global layers first .. first+n-1 (dense where model.moe_dense_layers says)."""
    if moe_spec is None:
        return [dense_spec] * n
    pattern = layer_pattern(cfg.model)
    return [moe_spec if pattern[i] else dense_spec for i in range(first, first + n)]
