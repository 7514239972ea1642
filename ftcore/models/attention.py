"""Core attention of the local (non-Transformer-Engine) layer spec, through torch's SDPA.

megatron's local DotProductAttention materialises GQA by repeat_interleave, then runs baddbmm, a
masked softmax and bmm, each a separate pass over [b, heads, s, s]. torch's
scaled_dot_product_attention does the same math in fused CPU kernels and reads the shared K/V
heads without copies: on CPU it made the tiny LoRA benchmark ~1.3x faster (README, Benchmarks).
Same inputs, mask convention and scale, so the loss is unchanged; megatron's path remains for what
SDPA here does not cover (attention dropout under TP's RNG tracker, softmax offsets, windows).
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SdpaAttention(DotProductAttention):
    def _megatron_only(self) -> bool:
        c = self.config
        return (
            (self.training and self.attention_dropout.p > 0)
            or self.softmax_offset is not None
            or c.window_size is not None
            or c.apply_query_key_layer_scaling
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):  # fmt: skip
        """[s, b, heads, d] in, [s, b, heads * d] out; attention_mask True = masked out."""
        if self._megatron_only() or attention_mask is None or attention_bias is not None:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)  # fmt: skip
        assert packed_seq_params is None, "packed rows take a block-diagonal mask on this path"
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        ctx = F.scaled_dot_product_attention(
            q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip
        s, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)
