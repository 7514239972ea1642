"""RoPE inverse frequencies exactly as Hugging Face computes them, installed into megatron's chunks.

megatron-core's RotaryEmbedding takes an integer base and only the llama3 `factor`; it hard-codes
`low_freq_factor=1`, `high_freq_factor=4` and `original_max_position_embeddings=8192`. A checkpoint
with other values (or a non-integer theta) would silently get different frequencies, so ftcore
computes HF's inv_freq from all four fields and overwrites megatron's after the build.
"""

from __future__ import annotations

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
    m = model_cfg
    head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
    scaling = None
    if m.rope_scaling is not None:
        scaling = {k: m.rope_scaling[k] for k in
                   ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}  # fmt: skip
    return inv_freq(head_dim, m.rope_theta, scaling)


def install(chunks, model_cfg) -> None:
    """Overwrite every chunk's rotary inv_freq (before any forward: megatron caches the embedding)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    freq = model_inv_freq(model_cfg)
    for chunk in chunks:
        rope = getattr(chunk, "rotary_pos_emb", None)
        if rope is None:
            continue
        rope.inv_freq = freq.to(rope.inv_freq.device)
    cache_clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
