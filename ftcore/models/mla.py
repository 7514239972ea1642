"""Multi-head latent attention (DeepSeek-V3, Kimi-K2): the model's MLA fields -> megatron-core's
MLATransformerConfig keys and MLA layer spec (docs/deepseek.md).

transformers' DeepseekV3Attention and megatron's MLASelfAttention compute the same thing from the
same weights: q = q_b(norm(q_a(x))) (or one q_proj), [k_nope, v] = kv_b(norm(kv_a(x)[:kv_lora])),
one rotary key kv_a(x)[kv_lora:] shared by every head, RoPE on the interleaved pairs of the
rotary part (transformers' rope_interleave, megatron's MLA de-interleave), softmax scale
mscale(factor, mscale_all_dim)^2 / sqrt(nope + rope) under YaRN. megatron's local core attention
takes no separate key and value widths, so the CPU path runs ftcore's SdpaAttention, which does.

The local spec (CPU) computes the two down projections (q_a, kv_a_proj_with_mqa) whole on every
TP rank, as TE's spec does ("duplicated"), not column-parallel as megatron's local spec has them:
there the shared rotary key is cut from a TP-gathered output and, full-length on every rank, gets
only that rank's heads' gradient back (megatron's gather's backward splits without summing), so
training at tp > 1 would drift (found by a layout parity run at ep=2 x tp=2).
Replicated, under sequence parallelism each rank projects its own tokens, the rotary key is
gathered over the sequence (its backward sums the heads' gradients) and megatron sums the weights'
gradients over TP (`sequence_parallel`). Training at tp > 1 needs SP (MoE does anyway).

transformers builds the two latent norms with eps 1e-6 whatever `rms_norm_eps` says; the local
spec does the same (`LatentNorm`). TE's spec fuses them into the up projections with the model's
eps (the same for DeepSeek-V3 and Kimi-K2, whose rms_norm_eps is 1e-6).
"""

from __future__ import annotations

from ftcore.config.families import family
from ftcore.models.local.norm import RMSNorm

HF_LATENT_EPS = 1e-6  # DeepseekV3RMSNorm's default, used for q_a_layernorm and kv_a_layernorm


class LatentNorm(RMSNorm):
    """RMSNorm of the q and kv latents with transformers' eps (module docstring)."""

    def __init__(self, config, hidden_size: int, eps: float = HF_LATENT_EPS, **_unused):
        super().__init__(config, hidden_size, eps=HF_LATENT_EPS)


def is_mla(m) -> bool:
    return family(m).mla


def transformer_kwargs(m) -> dict:
    """MLATransformerConfig's keys for the model (empty for standard attention). kv_channels is
    the value head width: megatron's core attention sizes its output from it."""
    if not is_mla(m):
        return {}
    r = m.rope_scaling
    yarn = r is not None and r.get("rope_type") == "yarn"
    return dict(
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=int(m.kv_lora_rank),
        qk_head_dim=int(m.qk_nope_head_dim),
        qk_pos_emb_head_dim=int(m.qk_rope_head_dim),
        v_head_dim=int(m.v_head_dim),
        kv_channels=int(m.v_head_dim),
        num_query_groups=int(m.num_attention_heads),
        qk_layernorm=True,  # the latent norms
        add_qkv_bias=False,
        rope_type="yarn" if yarn else "rope",
        rotary_base=float(m.rope_theta),
        rotary_scaling_factor=float(r.factor) if yarn else 1.0,
        original_max_position_embeddings=int(r.original_max_position_embeddings) if yarn else 4096,
        beta_fast=float(r.beta_fast) if yarn else 32.0,
        beta_slow=float(r.beta_slow) if yarn else 1.0,
        mscale=float(r.mscale) if yarn else 1.0,
        mscale_all_dim=float(r.mscale_all_dim) if yarn else 0.0,  # 0: softmax scale unchanged
        apply_rope_fusion=False,  # megatron's fused MLA RoPE is Triton (GPU) and YaRN-only
    )


def without_te() -> None:
    """megatron-core 0.16.1's MLA decides HAVE_TE by importing its TE extension, which imports
    without Transformer Engine too (its classes are then mock placeholders), and then calls
    isinstance(linear_proj, TELinear) on a placeholder: a TypeError wherever TE is absent. Where
    TELinear is no class, megatron's own "no TE" value is set. Idempotent; nothing edited."""
    from megatron.core.transformer import multi_latent_attention as mod

    if mod.HAVE_TE and not isinstance(mod.TELinear, type):
        mod.HAVE_TE = False


def cp_angles_on_cpu() -> None:
    """YaRN's rotary module takes this CP rank's angles with megatron's rope_utils function,
    which copies its index through pinned memory (no pinned memory without CUDA): ftcore's own
    (models/rope.py), the same angles, as rope.install does for standard attention. Before the
    build: the module computes its angles when built."""
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    from ftcore.models import rope

    yarn.get_pos_emb_on_this_cp_rank = rope.pos_emb_on_this_cp_rank


def local_spec(spec, norm, core_attention):
    """megatron's local MLA layer spec with ftcore's norms (SP-capable), SDPA attention and the
    down projections replicated (module docstring)."""
    from megatron.core.post_training.modelopt.layers import Linear

    without_te()
    cp_angles_on_cpu()
    attn = spec.submodules.self_attention.submodules
    attn.linear_q_down_proj = Linear
    attn.linear_kv_down_proj = Linear
    attn.q_layernorm = LatentNorm
    attn.kv_layernorm = LatentNorm
    attn.core_attention = core_attention
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    return spec
