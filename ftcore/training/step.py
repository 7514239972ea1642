"""The forward step megatron's forward_backward_func calls, the per-token loss, and one global
batch through the schedule (`run_batches`: training steps and the evaluation loop both use it).

Loss = sum of next-token cross entropy over the target tokens / their number, with the count
all-reduced by megatron (`calculate_per_token_loss`), so microbatching, DP and packing leave it
unchanged. Padded vocab entries are masked to -inf before the (vocab-parallel) cross entropy.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from ftcore.data import cp as cp_shard
from ftcore.data.packing import microbatch_iterators, real_tokens
from ftcore.data.pipeline import MicroBatch, attention_mask_from_segments
from ftcore.data.transfer import pin_host_batches, to_device
from ftcore.models import moe_routing, rope, target_logits, thd
from ftcore.models.local import attention, cp_attention
from ftcore.models.sharding import unwrap
from ftcore.runtime import collectives, cpu
from ftcore.runtime import dist as rdist


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
    labels, mask = to_device(mb.labels, output.device), to_device(mb.loss_mask, output.device)
    if rows is not None:
        labels, mask = target_logits.at_rows(labels, rows), target_logits.at_rows(mask, rows)
    losses = token_losses(output, labels, vocab_size)
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm": torch.stack([loss_sum.detach(), mask.sum()])}


def loss_sums(outputs: list[dict]) -> list[float]:
    """(loss sum, target tokens) over a step's micro-batch outputs (`loss_func`'s "lm"), read from
    the device in one transfer: the step's one intended host sync for its loss (none on the
    stages without a loss, whose output list is empty). Summed on the host in order, as before."""
    if not outputs:
        return [0.0, 0.0]
    rows = torch.stack([o["lm"] for o in outputs]).tolist()
    return [sum(r[0] for r in rows), sum(r[1] for r in rows)]


def packed_seq_params(mb: MicroBatch, device) -> PackedSeqParams:
    """THD layout for Transformer Engine's fused attention: documents of the packed row as
    cu_seqlens, so attention and RoPE restart per document without an s x s mask. cu_seqlens was
    built with the micro-batch; the longest length is a Python int and pad_between_seqs a bool
    from the host tensors (models/thd.py): TE reads nothing back from the device."""
    cu = to_device(mb.cu_seqlens, device)
    padded = None
    if mb.cu_seqlens_padded is not None:  # under CP: TE divides the whole row's by cp itself
        padded = to_device(mb.cu_seqlens_padded, device)
    between = thd.pad_between_seqs(mb.cu_seqlens, mb.cu_seqlens_padded)
    return thd.ThdParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                         cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                         max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen,
                         pad_between_seqs=between)  # fmt: skip


def local_batch(whole: MicroBatch, cp: int, cp_rank: int, device) -> MicroBatch:
    """This CP rank's chunks of the rows (data/cp.py); for a CUDA device the slices are pinned
    like the host batch they come from, so their non-blocking copies are not staged."""
    return cp_shard.shard(whole, cp, cp_rank, pin=pin_host_batches(device))


def lm_loss(whole: MicroBatch, mb: MicroBatch, vocab_size: int, rows):
    """The next-token loss of a micro-batch (`mb`, this CP rank's slice of `whole`)."""
    return partial(loss_func, mb, vocab_size, rows)


def forward_step(data_iterator, model, make_loss=lm_loss):
    """One micro-batch through this stage's chunk; the loss only on the last stage
    (`make_loss(whole, mb, vocab, rows)` builds it: the LM loss, DPO's or GRPO's, training/objectives/).

    On CPU (local attention) packed documents are kept apart by a block-diagonal causal mask; on
    GPU with Transformer Engine, packed rows go in as THD (cu_seqlens) and plain rows as causal.
    Under context parallelism the rank takes its chunks of every row, or of every document for
    packed rows (data/cp.py, TE's THD layout), and the local attention gets its query rows of the
    whole rows' mask (models/local/cp_attention.py) and RoPE the angles of its positions.
    The output layer runs at the target positions only where it can (models/target_logits.py).
    Inputs go to the device with non-blocking copies, and what depends on the data (masks,
    documents, target rows) is computed from the host tensors: no host sync per micro-batch."""
    whole: MicroBatch = next(data_iterator)
    device = next(model.parameters()).device
    chunk = unwrap(model)
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    mb = local_batch(whole, cp, cp_rank, device)
    rows = width = None
    if target_logits.applies(chunk):
        rows = to_device(target_logits.rows_of(mb.loss_mask), device)
        width = target_logits.widest(mb.loss_mask)
    kwargs, positions_of_rank = {}, None
    per_document = cp > 1 and whole.cu_seqlens_padded is not None  # THD layout (data/cp.py)
    packed = per_document or int(whole.segment_ids.max()) > 1
    if not getattr(chunk, "uses_te", False):
        mask = attention_mask_from_segments(to_device(whole.segment_ids, device))
        if cp > 1:  # this rank's query rows of the whole rows' mask (models/local/cp_attention.py)
            rows_of_rank = cp_shard.row_positions(whole, cp, cp_rank)
            gathered = cp_shard.gathered_row_positions(whole, cp)
            mask = cp_attention.local_mask(mask, rows_of_rank, gathered)
            if per_document:
                positions_of_rank = rows_of_rank
        elif packed:
            # packed rows: attend document by document (models/attention.py)
            mask = attention.with_documents(mask, attention.documents(mb.segment_ids).to(device))
    else:
        mask = None
        if packed:
            kwargs["packed_seq_params"] = packed_seq_params(mb, device)
    if getattr(chunk.config, "num_moe_experts", None):  # padding routes nowhere (moe_routing.py)
        real = real_tokens(whole)
        if cp > 1:
            real = real.gather(1, cp_shard.row_positions(whole, cp, cp_rank))
        kwargs["padding_mask"] = to_device(moe_routing.padding_mask(chunk, ~real), device)
    with (
        cpu.mode_suspended(),
        target_logits.only_at(chunk, rows, width),
        rope.angles_at(positions_of_rank),
    ):
        tokens, positions = to_device(mb.tokens, device), to_device(mb.position_ids, device)
        output = model(tokens, positions, mask, **kwargs)
    return output, make_loss(whole, mb, chunk.vocab_size_unpadded, rows)


def reduce_sums(values: list[float], contribute: bool) -> list[float]:
    """Sum over the whole world of the values of the ranks that contribute (others add zeros)."""
    t = torch.tensor(
        values if contribute else [0.0] * len(values),
        dtype=torch.float64,
        device=rdist.comm_device(),
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.all_reduce(t)
    return t.tolist()


def is_loss_rank() -> bool:
    return (
        ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    )


def is_data_rank() -> bool:
    """One rank per data-parallel replica: TP, PP and CP ranks all load the same micro-batches
    (CP slices its rows inside the step), so counting theirs would count every token again."""
    return (
        ps.get_pipeline_model_parallel_rank() == 0
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def run_batches(
    state, microbatches: list, *, forward_only: bool, timers=None
) -> tuple[float, float]:
    """forward(+backward) of one global batch; returns (loss sum, target tokens) over the world.
    `timers` (training/timing.py) goes to megatron's schedule for this call only."""
    out = schedule(state, microbatches, forward_only=forward_only, timers=timers)
    loss_sum, n = reduce_sums(loss_sums(out), is_loss_rank())
    return loss_sum, n


def schedule(
    state, microbatches: list, *, forward_only: bool, timers=None, step=forward_step, model=None
) -> list:
    """megatron's schedule over one global batch: `step` per micro-batch through `model`'s chunks
    (default the trained ones); the loss functions' outputs of this rank's last stage."""
    cfg = state.cfg
    model = model or state.model
    config = model[0].config
    config.timers = timers
    try:
        with cpu.device_mode():
            out = get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=microbatch_iterators(microbatches, len(model)),
                model=model if len(model) > 1 else model[0],
                num_microbatches=len(microbatches),
                seq_length=microbatches[0].tokens.shape[1],  # seq_len, or less when trimmed
                micro_batch_size=cfg.train.micro_batch_size,
                forward_only=forward_only,
            )
    finally:
        config.timers = None
    return out
