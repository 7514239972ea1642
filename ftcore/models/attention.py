"""Core attention of the local (non-Transformer-Engine) layer spec, through torch's SDPA.

megatron's local DotProductAttention materialises GQA by repeat_interleave, then runs baddbmm, a
masked softmax and bmm, each a separate pass over [b, heads, s, s]. torch's
scaled_dot_product_attention does the same math in fused CPU kernels and reads the shared K/V
heads without copies: on CPU it made the tiny LoRA benchmark ~1.3x faster (README, Benchmarks).
Same inputs, mask convention and scale, so the loss is unchanged; megatron's path remains for what
SDPA here does not cover (attention dropout under TP's RNG tracker, softmax offsets, windows).

Packed rows: the block-diagonal mask makes SDPA compute every [s, s] score of a row to keep a few
[len, len] blocks. When the mask carries its documents (`with_documents`, set by step.py from the
segment ids that built it), each document is attended on its own, causally, gathered with others
of similar length into a padded batch: what THD does on GPU. Documents of one token (and padding,
which attends only to itself) need no attention: their output is their value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


@dataclass
class Documents:
    """Where each document of a packed micro-batch sits in megatron's flattened [s, b] order."""

    buckets: list[torch.Tensor]  # per width: positions [n, width], short documents padded
    kept: list[torch.Tensor]  # per bucket: flat indices into [n * width] of the real tokens
    singles: torch.Tensor  # positions of one-token documents and of padding
    order: torch.Tensor  # inverse permutation: bucket outputs, then singles -> [s * b]

    def to(self, device) -> Documents:
        return Documents(*([t.to(device) for t in x] if isinstance(x, list) else x.to(device)
                           for x in (self.buckets, self.kept, self.singles, self.order)))  # fmt: skip


def bucket_width(length: int, min_width: int) -> int:
    """The next power of two or three quarters of one (16, 24, 32, 48, 64, 96, ...): two buckets
    per octave bound the attended area to 2.25x the documents' (vs 4x for powers of two; 20-30 token
    documents: A/B 0.988 of the packed step) and the SDPA calls per layer by 2 log2(s)."""
    w = max(min_width, length)
    p = 1 << (w - 1).bit_length()
    return p * 3 // 4 if p * 3 // 4 >= w else p


def documents(segment_ids: torch.Tensor, min_width: int = 16) -> Documents:
    """Runs of equal non-zero segment ids ([b, s], as attention_mask_from_segments reads them),
    bucketed by `bucket_width` of their length so little padding is attended."""
    b, s = segment_ids.shape
    by_width: dict[int, list[list[int]]] = {}
    singles: list[int] = []
    for r, row in enumerate(segment_ids.tolist()):
        start = 0
        for i in range(1, s + 1):
            if i < s and row[i] == row[start] and row[i] != 0:
                continue
            pos = [p * b + r for p in range(start, i)]
            if len(pos) == 1:
                singles += pos
            else:
                width = bucket_width(len(pos), min_width)
                by_width.setdefault(width, []).append(pos)
            start = i
    buckets, kept, dst = [], [], []
    for width in sorted(by_width):
        docs = by_width[width]
        buckets.append(torch.tensor([d + [d[0]] * (width - len(d)) for d in docs]))
        kept.append(
            torch.tensor([k * width + j for k, d in enumerate(docs) for j in range(len(d))])
        )
        dst += [p for d in docs for p in d]
    dst += singles
    order = torch.empty(len(dst), dtype=torch.long)
    order[torch.tensor(dst)] = torch.arange(len(dst))
    return Documents(buckets, kept, torch.tensor(singles, dtype=torch.long), order)


def with_documents(mask: torch.Tensor, docs: Documents) -> torch.Tensor:
    """The mask tensor, carrying its documents to SdpaAttention (a plain attribute: a copy of the
    mask loses it, and attention then takes the mask path, same math)."""
    mask.ftcore_documents = docs
    return mask


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
        s, b = query.shape[0], query.shape[1]
        docs = getattr(attention_mask, "ftcore_documents", None)
        if docs is not None:
            ctx = self._per_document(query, key, value, docs)
            return ctx.view(s, b, self.hidden_size_per_partition)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        ctx = F.scaled_dot_product_attention(
            q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip
        return ctx.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    def _per_document(self, query, key, value, docs: Documents) -> torch.Tensor:
        """Causal attention within each document; [s * b, heads, d] in megatron's order."""
        heads, groups = query.shape[2], key.shape[2]
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (query, key, value))  # [s * b, n, d]
        outs = []
        for idx, kept in zip(docs.buckets, docs.kept):
            n, width = idx.shape
            qd, kd, vd = (
                t.index_select(0, idx.view(-1)).view(n, width, *t.shape[1:]).transpose(1, 2)
                for t in (q, k, v)
            )  # [n, heads, width, d]; the padding after each document is never attended
            ctx = F.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, scale=self.softmax_scale, enable_gqa=groups != heads
            )
            outs.append(ctx.transpose(1, 2).reshape(n * width, heads, -1).index_select(0, kept))
        single = v.index_select(0, docs.singles)  # softmax over one key: its value
        outs.append(single.repeat_interleave(heads // groups, dim=1))
        return torch.cat(outs).index_select(0, docs.order)
