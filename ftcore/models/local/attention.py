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
which attends only to itself) need no attention: their output is their value. The buckets are
small (16-128 tokens), where batched matmuls (`causal_attention`) beat the flash kernel.

The last layer's queries are needed only at the target positions (models/target_logits.py asks
through `query_rows`): `attention_at_rows` attends just those.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch.nn.attention import SDPBackend, sdpa_kernel

from ftcore.data.transfer import to_device
from ftcore.models.local import cp_attention
from ftcore.models.local.gather import RowGather, gather


@dataclass
class HeadIndex:
    """Row gathers for one head layout, over tensors flattened to [tokens * heads, d] rows."""

    q: RowGather  # every bucket's [n * heads * width] query rows, as [n, groups, r * width]
    kv: RowGather  # every bucket's [n * groups * width] key/value rows, then the one-token docs'
    q_sizes: list[int]  # rows per bucket
    kv_sizes: list[int]  # rows per bucket, then the one-token documents' [singles * groups]
    out: RowGather  # [s * b * heads]: rows of cat(bucket outputs, singles) in megatron's order


@dataclass
class Documents:
    """Where each document of a packed micro-batch sits in megatron's flattened [s, b] order."""

    buckets: list[torch.Tensor]  # per width: positions [n, width], short documents padded
    kept: list[torch.Tensor]  # per bucket: flat indices into [n * width] of the real tokens
    spare: list[torch.Tensor]  # per bucket: flat indices into [n * width] of its padding
    singles: torch.Tensor  # positions of one-token documents and of padding
    order: torch.Tensor  # inverse permutation: bucket outputs, then singles -> [s * b]
    by_heads: dict = field(default_factory=dict)  # (heads, groups) -> HeadIndex, built once

    def to(self, device) -> Documents:
        def move(x):
            return (
                [to_device(t, device) for t in x] if isinstance(x, list) else to_device(x, device)
            )

        return Documents(
            *map(move, (self.buckets, self.kept, self.spare, self.singles, self.order))
        )

    def heads(self, heads: int, groups: int) -> HeadIndex:
        """Per-head row indices, so each bucket's Q, K and V arrive in attention's layout in one
        gather each and every output row goes home in one gather (built by the first layer)."""
        if (heads, groups) not in self.by_heads:
            self.by_heads[heads, groups] = _head_index(self, heads, groups)
        return self.by_heads[heads, groups]


def _head_index(docs: Documents, heads: int, groups: int) -> HeadIndex:
    """Each gather's backward gathers the gradient from a token's real slot (models/gather.py): a
    padded document's extra slots repeat its first token, and causal attention gives them zero
    gradient (their outputs are never read, and no real query attends them)."""
    dev = docs.order.device
    h = torch.arange(heads, device=dev)
    g = torch.arange(groups, device=dev)

    def slots(flat, width, ar, off):
        """[len(flat), len(ar)]: where bucket position `flat` (into [n * width]) lands per head
        in the bucket's [n, len(ar), width] layout, which starts at row `off`."""
        doc, j = flat // width, flat % width
        return off + (doc * ar.numel() * width + j)[:, None] + ar[None, :] * width

    q, kv, q_slot, kv_slot, spare, q_off, kv_off = [], [], [], [], [], 0, 0
    for pos, kept, pad in zip(docs.buckets, docs.kept, docs.spare):
        n, width = pos.shape
        q.append((pos[:, None, :] * heads + h[None, :, None]).reshape(-1))  # [n, heads, width]
        kv.append((pos[:, None, :] * groups + g[None, :, None]).reshape(-1))
        q_slot.append(slots(kept, width, h, q_off))  # the real tokens' slots
        kv_slot.append(slots(kept, width, g, kv_off))
        spare.append(slots(pad, width, h, q_off).view(-1))
        q_off, kv_off = q_off + n * heads * width, kv_off + n * groups * width
    ones = docs.singles[:, None]  # one-token documents: no query, their value per group
    kv.append((ones * groups + g[None, :]).reshape(-1))
    kv_slot.append(kv_off + torch.arange(kv[-1].numel(), device=dev).view(-1, groups))
    q_slot.append(q_off + torch.arange(ones.numel() * heads, device=dev).view(-1, heads))
    out = torch.cat(q_slot)[docs.order].reshape(-1)  # per [s * b, heads] row: its output slot
    none = torch.empty(0, dtype=torch.long, device=dev)  # every document is one token long
    q_index, kv_index = torch.cat([none, *q]), torch.cat(kv)
    singles_q = (ones * heads + h[None, :]).reshape(-1)
    return HeadIndex(
        # a query row's gradient sits where its output does; one-token documents' are zero
        RowGather(q_index, out.clamp(max=max(q_off - 1, 0)), singles_q),
        RowGather(kv_index, torch.cat(kv_slot)[docs.order].reshape(-1), none),
        [t.numel() for t in q],
        [t.numel() for t in kv],
        # an output slot's gradient: its row of megatron's order, zero for padding
        RowGather(out, torch.cat([q_index, singles_q]), torch.cat([none, *spare])),
    )


def bucket_width(length: int, min_width: int) -> int:
    """The next power of two or three quarters of one (16, 24, 32, 48, 64, 96, ...): two buckets
    per octave bound the attended area to 2.25x the documents' (vs 4x for powers of two; 20-30 token
    documents: A/B 0.988 of the packed step) and the SDPA calls per layer by 2 log2(s)."""
    w = max(min_width, length)
    p = 1 << (w - 1).bit_length()
    return p * 3 // 4 if p * 3 // 4 >= w else p


def documents(segment_ids: torch.Tensor, min_width: int = 16) -> Documents:
    """Runs of equal non-zero segment ids ([b, s], as attention_mask_from_segments reads them),
    bucketed by `bucket_width` of their length so little padding is attended. Vectorised: it runs
    once per micro-batch on the step's critical path."""
    seg = segment_ids.cpu()
    b, s = seg.shape
    new = torch.ones_like(seg, dtype=torch.bool)  # a run starts here (padding: every token)
    new[:, 1:] = (seg[:, 1:] != seg[:, :-1]) | (seg[:, 1:] == 0)
    starts = new.view(-1).nonzero().squeeze(1)  # runs in row-major order: row, then position
    lengths = torch.diff(starts, append=torch.tensor([b * s]))
    row, start = starts // s, starts % s
    is_single = lengths == 1
    width_of = {n: bucket_width(n, min_width) for n in set(lengths.tolist())}
    widths = torch.tensor([width_of[n] for n in lengths.tolist()])
    buckets, kept, spare, dst = [], [], [], []
    for width in sorted({width_of[n] for n in lengths[~is_single].tolist()}):
        pick = (widths == width) & ~is_single
        n, r0, p0 = lengths[pick], row[pick], start[pick]
        j = torch.arange(width)
        real = j[None, :] < n[:, None]  # [docs, width]
        pos = p0[:, None] + torch.where(real, j[None, :], 0)  # padding repeats the first token
        flat = pos * b + r0[:, None]
        buckets.append(flat)
        kept.append(real.view(-1).nonzero().squeeze(1))
        spare.append((~real).view(-1).nonzero().squeeze(1))
        dst.append(flat[real])
    singles = start[is_single] * b + row[is_single]
    dst = torch.cat([*dst, singles])
    order = torch.empty_like(dst)
    order[dst] = torch.arange(dst.numel())
    return Documents(buckets, kept, spare, singles, order)


def with_documents(mask: torch.Tensor, docs: Documents) -> torch.Tensor:
    """The mask tensor, carrying its documents to SdpaAttention (a plain attribute: a copy of the
    mask loses it, and attention then takes the mask path, same math)."""
    mask.ftcore_documents = docs
    return mask


_CAUSAL: dict[tuple, torch.Tensor] = {}
# On CUDA, SDPA calls whose shapes change with every micro-batch (document buckets, target rows)
# stay off cuDNN: it builds an execution plan per new shape, ~7-8 ms of host time per call in
# tools/gpu_profile.py on an H200 (docs/gpu/2026-11-26-nvidia-h200.md), with the GPU idle half
# the step. Flash (causal, GQA) and memory-efficient (masks) kernels need no plan; math is the
# fallback that takes anything.
VARYING_SHAPES = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def on_cuda(t: torch.Tensor) -> bool:
    """Where the CUDA-only choices below apply (a function, so CPU tests can take that path)."""
    return t.is_cuda


def varying_shapes(t: torch.Tensor):
    """The SDPA backends for a call whose shapes vary per micro-batch (see VARYING_SHAPES)."""
    return sdpa_kernel(VARYING_SHAPES) if on_cuda(t) else contextlib.nullcontext()


MATMUL_WIDTH = 128  # widest bucket for causal_attention (fp32, fp64): it keeps [heads, w, w]


def causal_attention(q, k, v, scale: float) -> torch.Tensor:
    """Causal attention of short equal-width sequences, [n, heads, w, d] -> same shape.

    Each KV group's query heads are stacked into one [r * w, d] matrix against its [w, d] keys, so
    GQA needs no copies of K/V, and scale and causal mask go in with one baddbmm. For the 16-128
    token buckets of packed documents this is 1.1-1.8x faster (forward + backward) than torch's
    flash kernel for CPU, whose per-block overhead dominates at these sizes.
    """
    n, heads, w, d = q.shape
    groups = k.shape[1]
    r = heads // groups
    key = (w, r, q.dtype, q.device)
    mask = _CAUSAL.get(key)
    if mask is None:
        mask = torch.full((w, w), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        mask = _CAUSAL[key] = mask.repeat(r, 1)  # row i * w + j: query j of the group's head i
    scores = torch.baddbmm(
        mask, q.reshape(n * groups, r * w, d), k.reshape(n * groups, w, d).transpose(1, 2),
        alpha=scale,
    )  # fmt: skip
    ctx = torch.bmm(torch.softmax(scores, dim=-1), v.reshape(n * groups, w, d))
    return ctx.view(n, heads, w, d)


def attention_at_rows(
    query, key, value, mask, rows, scale: float, width: int | None = None
) -> torch.Tensor:
    """The attention output at the flattened [s, b] positions `rows` only, [n, heads * d].

    The last layer's output matters only where the loss reads it (models/target_logits.py): its
    keys and values need every position, its queries only those. The rows are laid out per
    sequence in a [b, width] grid (width: the most rows of one sequence; spare cells query
    position 0, which attends itself, and are dropped), and SDPA attends them with their own mask
    rows: packed and padded batches take the same path, ~15% of the full attention's scores."""
    s, b, heads, d = query.shape
    n = rows.numel()
    col = rows % b
    order = torch.argsort(col * (s * b) + rows)  # by sequence, then position
    # rows per sequence; not torch.bincount, whose output size is a device read (a host sync per
    # micro-batch on CUDA, found by tests/gpu/test_host_sync.py on an H200)
    counts = torch.zeros(b, dtype=col.dtype, device=col.device).index_add_(
        0, col, torch.ones_like(col)
    )
    if width is None:  # a device read; the training step passes it from the host mask
        width = int(counts.max())
    by_col = col[order]
    first = (counts.cumsum(0) - counts)[by_col]  # each row's sequence starts there in `order`
    cell = by_col * width + torch.arange(n, device=rows.device) - first
    grid = torch.arange(b, device=rows.device).repeat_interleave(width)  # position 0 of each
    grid[cell] = rows[order]
    pos, seq = grid // b, grid % b
    q = query.reshape(s * b, heads, d).index_select(0, grid).view(b, width, heads, d)
    k, v = (t.permute(1, 2, 0, 3) for t in (key, value))  # [b, groups, s, d]
    own = mask[seq if mask.shape[0] > 1 else torch.zeros_like(seq), 0, pos]  # True = masked out
    if on_cuda(q) and k.shape[1] != heads:  # the memory-efficient kernel takes masks, not GQA
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    with varying_shapes(q):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=~own.view(b, 1, width, s), scale=scale,
            enable_gqa=k.shape[1] != heads,
        )  # fmt: skip
    home = torch.empty_like(order)
    home[order] = cell
    return out.transpose(1, 2).reshape(b * width, heads * d).index_select(0, home)


class SdpaAttention(DotProductAttention):
    # target_logits sets query_rows for one forward of the last layer; rows_done says it was served
    query_rows: torch.Tensor | None = None
    query_width: int | None = None  # target_logits.widest of the micro-batch
    rows_done: bool = False

    def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
        # megatron's local attention asserts context_parallel_size == 1; this one attends CP
        # shards itself (cp_attention.py), so its parent is built as at cp=1. MLA passes its key
        # and value widths (megatron's local attention takes neither): the output is sized by
        # kv_channels, which models/mla.py sets to the value width.
        cp = config.context_parallel_size
        at_cp1 = config
        if cp > 1:
            at_cp1 = copy.copy(config)
            at_cp1.context_parallel_size = 1
        super().__init__(at_cp1, *args, **kwargs)
        self.cp = cp
        if cp == 1:
            return
        self.config = config  # the shared one (megatron sets fields on it at run time)
        from megatron.core import parallel_state as ps

        self.cp_group = ps.get_context_parallel_group()

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
        """[s, b, heads, d] in, [s, b, heads * d] out; attention_mask True = masked out. Values
        narrower than the keys (MLA) are padded with zero columns, which leave every output
        column as it was, and cut off again: one attention path for every width."""
        dv = value.shape[-1]
        if dv != query.shape[-1]:
            wide = max(dv, query.shape[-1])  # zero columns of q and k add nothing to q.k
            query, key, value = (F.pad(t, (0, wide - t.shape[-1])) for t in (query, key, value))
            ctx = self._forward(query, key, value, attention_mask, attn_mask_type,
                                attention_bias, packed_seq_params)  # fmt: skip
            return ctx.unflatten(-1, (-1, wide))[..., :dv].flatten(-2)
        return self._forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                             packed_seq_params)  # fmt: skip

    def _forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                 packed_seq_params):  # fmt: skip
        width = query.shape[2] * value.shape[3]  # heads x value width of this partition
        if self.cp > 1:
            return self._context_parallel(query, key, value, attention_mask, attention_bias,
                                          packed_seq_params)  # fmt: skip
        if self._megatron_only() or attention_mask is None or attention_bias is not None:
            if width != self.hidden_size_per_partition:  # MLA: megatron's path sizes by kv_channels
                raise RuntimeError("MLA on the local attention takes SDPA's path (no dropout, "
                                   "softmax offset, window or bias; a mask from step.py)")  # fmt: skip
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)  # fmt: skip
        assert packed_seq_params is None, "packed rows take a block-diagonal mask on this path"
        s, b = query.shape[0], query.shape[1]
        rows = self.query_rows
        if rows is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1:
            if 2 * rows.numel() <= s * b:  # else attending every row costs less
                self.rows_done = True
                ctx = attention_at_rows(query, key, value, attention_mask, rows,
                                        self.softmax_scale, self.query_width)  # fmt: skip
                return ctx.view(-1, 1, width)
        docs = getattr(attention_mask, "ftcore_documents", None)
        if docs is not None:
            ctx = self._per_document(query, key, value, docs)
            return ctx.view(s, b, width)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        ctx = F.scaled_dot_product_attention(
            q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip
        return ctx.permute(2, 0, 1, 3).reshape(s, b, width)

    def _context_parallel(self, query, key, value, mask, bias, packed_seq_params):
        if self._megatron_only() or mask is None or bias is not None or packed_seq_params:
            # a guard, not a gap: step.py always gives the CPU path a mask and no THD input, and
            # ftcore configures none of the others
            raise RuntimeError(
                "context parallelism on the local attention takes a mask from step.py and no "
                "dropout, softmax offset, window, bias or THD input"
            )
        return cp_attention.attention(query, key, value, mask, self.softmax_scale, self.cp_group)

    def _per_document(self, query, key, value, docs: Documents) -> torch.Tensor:
        """Causal attention within each document; [s * b, heads, d] in megatron's order."""
        heads, groups, d = query.shape[2], key.shape[2], query.shape[3]
        index = docs.heads(heads, groups)
        q, k, v = (t.reshape(-1, d) for t in (query, key, value))  # [s * b * heads, d] rows
        exact = q.dtype in (torch.float32, torch.float64)  # flash accumulates bf16 in fp32
        qs = gather(q, index.q).split(index.q_sizes)  # one gather for every bucket
        ks, (*vs, v1) = (gather(t, index.kv).split(index.kv_sizes) for t in (k, v))
        outs = []
        for pos, qd, kd, vd in zip(docs.buckets, qs, ks, vs):
            n, width = pos.shape
            qd = qd.view(n, heads, width, d)
            kd, vd = kd.view(n, groups, width, d), vd.view(n, groups, width, d)
            # causal: no token of a document attends the padding after it
            if width <= MATMUL_WIDTH and exact:
                ctx = causal_attention(qd, kd, vd, self.softmax_scale)
            else:  # flash: its memory grows with width, not width squared
                with varying_shapes(qd):
                    ctx = F.scaled_dot_product_attention(
                        qd, kd, vd, is_causal=True, scale=self.softmax_scale, enable_gqa=True
                    )
            outs.append(ctx.reshape(-1, d))
        # softmax over one key: its value, the group's for each of its query heads
        outs.append(v1.view(-1, groups, 1, d).expand(-1, groups, heads // groups, d).reshape(-1, d))
        return gather(torch.cat(outs), index.out).view(-1, heads, d)
