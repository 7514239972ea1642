"""The forward step megatron's forward_backward_func calls, and the per-token loss.

Loss = sum of next-token cross entropy over the target tokens / their number, with the count
all-reduced by megatron (`calculate_per_token_loss`), so microbatching, DP and packing leave it
unchanged. Padded vocab entries are masked to -inf before the (vocab-parallel) cross entropy.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams

from ftcore.data.packing import cu_seqlens_from_segments
from ftcore.data.pipeline import MicroBatch, attention_mask_from_segments
from ftcore.models import attention, target_logits
from ftcore.models.sharding import unwrap
from ftcore.runtime import cpu


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-inf for the padded vocab columns this TP rank holds (logits are vocab-parallel)."""
    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits
    col = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(col >= vocab_size, float("-inf"))


def token_losses(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-position cross entropy [b, s] from vocab-parallel logits [b, s, v/tp]."""
    logits = mask_padded_vocab(logits.float(), vocab_size).contiguous()
    if logits._base is not None:  # megatron's cross entropy works in place: not on a view
        logits = logits.clone()
    return tensor_parallel.vocab_parallel_cross_entropy(logits, labels)


def loss_func(mb: MicroBatch, vocab_size: int, rows, output: torch.Tensor):
    with cpu.mode_suspended():
        return _loss(mb, vocab_size, rows, output)


def _loss(mb: MicroBatch, vocab_size: int, rows, output: torch.Tensor):
    """rows: the positions the logits were computed at (models/target_logits.py), or None."""
    labels, mask = mb.labels.to(output.device), mb.loss_mask.to(output.device)
    if rows is not None:
        labels, mask = target_logits.at_rows(labels, rows), target_logits.at_rows(mask, rows)
    losses = token_losses(output, labels, vocab_size)
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm": torch.stack([loss_sum.detach(), mask.sum()])}


def packed_seq_params(mb: MicroBatch, device) -> PackedSeqParams:
    """THD layout for Transformer Engine's fused attention: documents of the packed row as
    cu_seqlens, so attention and RoPE restart per document without an s x s mask."""
    cu, longest = cu_seqlens_from_segments(mb.segment_ids)
    cu = cu.to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip


def forward_step(data_iterator, model):
    """One micro-batch through this stage's chunk; the loss only on the last stage.

    On CPU (local attention) packed documents are kept apart by a block-diagonal causal mask; on
    GPU with Transformer Engine, packed rows go in as THD (cu_seqlens) and plain rows as causal.
    The output layer runs at the target positions only where it can (models/target_logits.py)."""
    mb: MicroBatch = next(data_iterator)
    device = next(model.parameters()).device
    chunk = unwrap(model)
    rows = target_logits.rows_of(mb.loss_mask).to(device) if target_logits.applies(chunk) else None
    kwargs = {}
    packed = int(mb.segment_ids.max()) > 1
    if not getattr(chunk, "uses_te", False):
        mask = attention_mask_from_segments(mb.segment_ids).to(device)
        if packed and chunk.config.context_parallel_size == 1:
            # packed rows: attend document by document (models/attention.py)
            mask = attention.with_documents(mask, attention.documents(mb.segment_ids).to(device))
    else:
        mask = None
        if packed:
            kwargs["packed_seq_params"] = packed_seq_params(mb, device)
    with cpu.mode_suspended(), target_logits.only_at(chunk, rows):
        output = model(mb.tokens.to(device), mb.position_ids.to(device), mask, **kwargs)
    return output, partial(loss_func, mb, chunk.vocab_size_unpadded, rows)


def microbatch_iterators(microbatches: list[MicroBatch], num_chunks: int):
    """megatron wants one iterator per virtual stage, each over the same micro-batches."""
    its = [iter(microbatches) for _ in range(num_chunks)]
    return its if num_chunks > 1 else its[0]
