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

from ftcore.data.pipeline import MicroBatch, attention_mask_from_segments
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
    logits = mask_padded_vocab(logits.float(), vocab_size)
    return tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), labels)


def loss_func(mb: MicroBatch, vocab_size: int, output: torch.Tensor):
    losses = token_losses(output, mb.labels.to(output.device), vocab_size)
    mask = mb.loss_mask.to(losses.device)
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm": torch.stack([loss_sum.detach(), mask.sum()])}


def forward_step(data_iterator, model):
    """One micro-batch through this stage's chunk; the loss only on the last stage."""
    mb: MicroBatch = next(data_iterator)
    device = next(model.parameters()).device
    mask = attention_mask_from_segments(mb.segment_ids).to(device)
    with cpu.mode_suspended():
        output = model(mb.tokens.to(device), mb.position_ids.to(device), mask)
    return output, partial(loss_func, mb, unwrap(model).vocab_size_unpadded)


def microbatch_iterators(microbatches: list[MicroBatch], num_chunks: int):
    """megatron wants one iterator per virtual stage, each over the same micro-batches."""
    its = [iter(microbatches) for _ in range(num_chunks)]
    return its if num_chunks > 1 else its[0]
