"""RoPE inverse frequencies exactly as Hugging Face computes them, installed into megatron's chunks.

megatron-core's RotaryEmbedding takes an integer base and only the llama3 `factor`; it hard-codes
`low_freq_factor=1`, `high_freq_factor=4` and `original_max_position_embeddings=8192`. A checkpoint
with other values (or a non-integer theta) would silently get different frequencies, so ftcore
computes HF's inv_freq from all four fields and overwrites megatron's after the build.
"""

from __future__ import annotations

import contextlib
import math

import torch


def inv_freq(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    """float32 [head_dim // 2], the same arithmetic as transformers' default / llama3 RoPE init."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    freq = 1.0 / (float(theta) ** exponents)
    if scaling is None:
        return freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def model_inv_freq(model_cfg) -> torch.Tensor:
    """The inverse frequencies of the rotated part of the head (GLM-4.5: its first half)."""
    m = model_cfg
    head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
    head_dim = int(head_dim * float(m.get("rotary_percent") or 1.0))  # as transformers rounds
    scaling = None
    if m.rope_scaling is not None and m.rope_scaling.get("rope_type", "llama3") == "llama3":
        scaling = {k: m.rope_scaling[k] for k in
                   ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}  # fmt: skip
    return inv_freq(head_dim, m.rope_theta, scaling)


def install(chunks, model_cfg) -> None:
    """Overwrite every chunk's rotary inv_freq (before any forward: megatron caches the embedding)."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    freq = model_inv_freq(model_cfg)
    for chunk in chunks:
        rope = getattr(chunk, "rotary_pos_emb", None)
        if rope is None:
            continue
        rope.inv_freq = freq.to(rope.inv_freq.device)
    cache_clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


_positions: list = [None]  # [b, s / cp] row positions of this rank (angles_at), or None


@contextlib.contextmanager
def angles_at(positions: torch.Tensor | None):
    """Within: RoPE angles at these per-row positions ([b, s / cp], data/cp.py row_positions),
    not the whole-row chunks: packed rows under CP split per document (no-TE path; with TE,
    megatron's THD RoPE does it). megatron caches its rotary embedding: cleared around it."""
    if positions is None:
        yield
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,  # MLA's (models/mla.py): a cache of its own
    )

    _positions[0] = positions
    RotaryEmbedding.forward.cache_clear()
    YarnRotaryEmbedding.forward.cache_clear()
    try:
        yield
    finally:
        _positions[0] = None
        RotaryEmbedding.forward.cache_clear()
        YarnRotaryEmbedding.forward.cache_clear()


def pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron's get_pos_emb_on_this_cp_rank (the angles of this CP rank's chunks r and
    2*cp-1-r, ftcore.data.cp), on the embedding's own device: megatron's copies its index through
    pinned memory to CUDA, which a CPU run has neither of. Inside `angles_at`: [s / cp, b, 1, d],
    each row's angles at its own positions."""
    from ftcore.data.cp import local_positions

    if _positions[0] is not None:
        p = _positions[0].to(pos_emb.device)  # [b, s / cp]
        picked = pos_emb.index_select(seq_dim, p.t().reshape(-1))  # [s / cp * b, 1, 1, d]
        return picked.view(p.shape[1], p.shape[0], *pos_emb.shape[seq_dim + 2 :])
    index = local_positions(pos_emb.shape[seq_dim], cp_group.size(), cp_group.rank())
    return pos_emb.index_select(seq_dim, index.to(pos_emb.device))


class _Rotate(torch.autograd.Function):
    """t * cos + rotate_half(t) * sin for [s, b, heads, d] (halves layout), as one autograd node.

    megatron's unfused path recomputes cos and sin of the frequencies for every query and key of
    every layer, concatenates for rotate_half and for an empty pass-through part, and autograd
    keeps each piece: ~20 small ops per call on CPU. Here: cos and sin once per micro-batch, three
    ops forward and three backward (the backward is the rotation by -angle)."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        h = t.shape[-1] // 2
        out = t * cos
        out[..., :h].addcmul_(t[..., h:], sin[..., :h], value=-1.0)
        out[..., h:].addcmul_(t[..., :h], sin[..., h:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        h = grad.shape[-1] // 2
        dt = grad * cos
        dt[..., :h].addcmul_(grad[..., h:], sin[..., h:])
        dt[..., h:].addcmul_(grad[..., :h], sin[..., :h], value=-1.0)
        return dt, None, None


_cos_sin: list = [None, -1, None]  # [freqs, its version, (cos, sin)]: one freqs for every layer


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's `fused_apply_rotary_pos_emb` signature (TE's on GPU), installed on CPU by
    `use_cpu_rope`. freqs: [s, b or 1, 1, rot_dim] angles; a partial rot_dim passes the rest."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    if interleaved or freqs.shape[-1] != t.shape[-1] or freqs.requires_grad:
        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    if _cos_sin[0] is not freqs or _cos_sin[1] != freqs._version:
        _cos_sin[:] = [freqs, freqs._version, (freqs.cos(), freqs.sin())]
    cos, sin = _cos_sin[2]
    if cos.dtype != t.dtype:
        cos, sin = cos.to(t.dtype), sin.to(t.dtype)
    return _Rotate.apply(t, cos, sin)


def use_cpu_rope() -> bool:
    """Route megatron's RoPE through `apply_rope` where Transformer Engine's fused kernel is absent;
    True when installed (then `apply_rope_fusion` may be set in the TransformerConfig)."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb not in (None, apply_rope):
        return False  # TE's kernel is there: keep it
    rope_utils.fused_apply_rotary_pos_emb = apply_rope
    return True


def use_fused_rope(on_cpu: bool) -> bool:
    """`apply_rope_fusion` for megatron's TransformerConfig: a fused RoPE kernel wherever one is.

    On GPU with Transformer Engine, TE's kernels: megatron's unfused path for packed (THD) rows
    splits the tokens by `cu_seqlens.tolist()` in every attention layer, a host sync per layer per
    micro-batch, while TE's THD kernel reads cu_seqlens on the device. Elsewhere (CPU, or a GPU
    without TE, where packed rows take the mask path, never THD) ftcore's `apply_rope` is installed
    as megatron's bshd kernel; on CPU a TE kernel is never used. megatron 0.16 accepts the flag when
    either of its kernels (`fused_apply_rotary_pos_emb[_thd]`) is set and rotary_interleaved is off
    or TE >= 2.3; it falls back to its unfused code only for mRoPE or an mscale != 1 (not Llama)."""
    from megatron.core.models.common.embeddings import rope_utils

    te_kernel = rope_utils.fused_apply_rotary_pos_emb not in (None, apply_rope)
    if te_kernel and not on_cpu:
        return True
    return use_cpu_rope()
