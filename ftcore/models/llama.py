"""Llama shapes (the `model` config group) -> megatron-core TransformerConfig and layer spec."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig
from omegaconf import DictConfig

from ftcore.config.families import family
from ftcore.models import mla, moe, rope, speed
from ftcore.models.local.attention import SdpaAttention
from ftcore.models.local.norm import RMSNorm
from ftcore.models.nf4 import defer_base_linears
from ftcore.planner import cp
from ftcore.planner.layers import split_for
from ftcore.runtime import device_audit

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron needs the vocab to divide by TP; pad to a multiple of 128·tp like megatron does."""
    m = multiple * tp
    return ((vocab_size + m - 1) // m) * m


def family_flags(m) -> dict:
    """megatron TransformerConfig switches of the family (models/llama.transformer_config)."""
    f = family(m)
    return {"add_qkv_bias": f.qkv_bias, "qk_layernorm": f.qk_layernorm}


def local_qk_norms(spec, m, norm) -> None:
    """Put ftcore's RMSNorm (models/local/norm.py) on q and k in megatron's local layer spec when
    the family normalises each head (megatron builds it with hidden_size = head dim and sums its
    gradient over the TP group itself: finalize_model_grads, `qk_layernorm`)."""
    if family(m).qk_layernorm:
        spec.submodules.self_attention.submodules.q_layernorm = norm
        spec.submodules.self_attention.submodules.k_layernorm = norm


def _no_init(tensor: torch.Tensor) -> None:
    return None


def transformer_config(cfg: DictConfig, *, on_cpu: bool) -> TransformerConfig:
    m, p = cfg.model, cfg.parallel
    dtype = DTYPES[cfg.precision.params_dtype]
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels or m.hidden_size // m.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        **family_flags(m),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_std,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vp if p.vp > 1 else None,
        context_parallel_size=p.cp,
        # TE's K/V exchange on GPU (docs/context_parallel.md); the CPU attention all-gathers
        cp_comm_type=p.cp_comm_type if p.cp > 1 else None,
        hierarchical_context_parallel_sizes=cp.hierarchical_sizes(p),
        sequence_parallel=p.sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        calculate_per_token_loss=True,  # loss = sum over target tokens / their number (docs/parallelism.md)
        # the device audit builds as on a GPU, so that megatron's weights are born on "the GPU"
        use_cpu_initialization=on_cpu and not device_audit.active(),
        # megatron's init runs (it marks the TP attributes of each weight) but draws nothing:
        # ftcore initialises layout-independently afterwards (models/init.py).
        perform_initialization=True,
        init_method=_no_init,
        output_layer_init_method=_no_init,
        embedding_init_method=_no_init,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        # fused RoPE: ftcore.models.rope.apply_rope on CPU, TE's kernels on GPU (no per-layer
        # host sync for packed rows)
        apply_rope_fusion=rope.use_fused_rope(on_cpu),
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        deallocate_pipeline_outputs=not on_cpu,
        **split_for(cfg).megatron_flags(),
        # overlap, fusions (on CPU megatron's bias-SwiGLU hook runs models/local/swiglu.py), p2p
        # batching, recompute, CUDA graphs: models/speed.py
        **speed.transformer_kwargs(cfg, on_cpu=on_cpu),
        **moe.transformer_kwargs(cfg, on_cpu=on_cpu),  # experts, router, dispatcher (MoE only)
    )
    kwargs.update(mla.transformer_kwargs(m))  # latent attention's shapes and YaRN (DeepSeek-V3)
    if not on_cpu:
        from ftcore.precision import recipes

        kwargs.update(recipes.transformer_config_kwargs(cfg))
    return (MLATransformerConfig if mla.is_mla(m) else TransformerConfig)(**kwargs)


def layer_spec(cfg: DictConfig, config: TransformerConfig, *, on_cpu: bool, vp_stage, pp_rank):
    """Local spec with an SP-capable RMSNorm and SDPA core attention on CPU; Transformer Engine's
    spec on GPU. MoE: the MoE layer's spec on sparse layers (models/moe.py)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if not on_cpu:
        from ftcore.precision import recipes

        spec = recipes.layer_spec(cfg)  # None: no TE, precision.te_layers=false, or QLoRA
        if spec is not None:
            from ftcore.models import thd

            thd.install(spec)  # pad_between_seqs from the host, not read back per layer
            if not moe.is_moe(cfg.model):
                return spec
            sparse = moe.moe_layer_spec(cfg, spec, on_cpu=False)
            thd.install(sparse)
            from megatron.core.extensions.transformer_engine import TENorm

            specs = moe.layer_specs(cfg, spec, sparse, first=first, n=n)
            return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TENorm)
    norm = ModuleSpec(module=RMSNorm)
    if mla.is_mla(cfg.model):
        spec = get_gpt_layer_local_spec(
            normalization="RMSNorm", multi_latent_attention=True, qk_layernorm=True
        )
        mla.local_spec(spec, norm, SdpaAttention)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        local_qk_norms(spec, cfg.model, norm)
        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
    if cfg.peft.name == "qlora" and (cfg.model.hf_path or cfg.model.init_path):
        defer_base_linears(spec, cfg.peft.double_quant)  # NF4 as loaded: no full-precision base
    sparse = moe.moe_layer_spec(cfg, spec, on_cpu=True) if moe.is_moe(cfg.model) else None
    specs = moe.layer_specs(cfg, spec, sparse, first=first, n=n)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)
