"""One global batch of preference pairs through the schedule (docs/preference.md): a forward-only
pass of the reference, then the policy's forward(+backward) with DPO's loss.

Both passes go through megatron's schedule, so the reference's log-probs arrive on the last
pipeline stage at every layout: the reference pass stores each micro-batch's [pairs, 2] sequence
log-probs there, keyed by the micro-batch, and the policy's loss reads them. Per-token log-probs
are -(vocab-parallel cross entropy) (step.token_losses: reduced over TP); under CP each rank sums
its own tokens per (pair, side) and the sums are all-reduced over the CP group (their gradient
passes through unchanged: megatron sums the ranks' gradients). The loss of a micro-batch is the
sum of its pairs' losses and its count the number of pairs, on CP rank 0 only: megatron divides the
gradients by the count summed over DP x CP (`calculate_per_token_loss`), the mean over the global
batch's pairs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial

import torch
from megatron.core import parallel_state as ps

from ftcore.data.transfer import pin_host_batches, to_device
from ftcore.models import target_logits
from ftcore.precision import delayed
from ftcore.runtime import collectives, cpu
from ftcore.runtime import dist as rdist
from ftcore.training.objectives.dpo import loss as preference
from ftcore.training.step import forward_step, is_loss_rank, reduce_sums, schedule, token_losses


@dataclass
class Reference:
    """What the reference forward runs: `chunks` (a frozen copy; None: the policy's own) inside
    `context()` (LoRA: the adapters off, or the reference adapter swapped in)."""

    chunks: list | None = None
    ref_adapter: dict | None = None
    policy: list = field(default_factory=list)  # the policy's unwrapped chunks (LoRA)
    # objective.precompute_ref (objectives/dpo/ref_store.py): [pairs, 2] log-probs by sample id, of the
    # training stream ("train") and the held-out pairs ("val", the batches in `val_batches`)
    tables: dict | None = None
    val_batches: set = field(default_factory=set)

    def stored(self, mb, device) -> torch.Tensor:
        """The stored [num_pairs, 2] reference log-probs of a micro-batch's pairs, on `device`:
        picked from the host table before the schedule and copied without the host waiting
        (pinned, non-blocking), not inside the loss in the pipeline."""
        table = self.tables["val" if id(mb) in self.val_batches else "train"]
        rows = table[list(mb.pair_ids or ())]
        return to_device(rows.pin_memory() if pin_host_batches(device) else rows, device)

    def context(self):
        from ftcore.peft import reference as peft_ref

        if self.chunks is not None:
            return contextlib.nullcontext()
        if self.ref_adapter is not None:
            return peft_ref.adapter_swapped(self.policy, self.ref_adapter)
        return peft_ref.adapters_off(self.policy)


def build_reference(cfg, chunks: list, precompute: bool = False) -> Reference:
    """Before DDP and resume (trainer.setup): LoRA's reference lives in the policy; full
    fine-tuning's is a frozen copy of the policy's starting weights, sharded like it, or (with
    `precompute`, objectives/dpo/ref_store.py) the policy itself for the one pass before training."""
    if cfg.peft.name != "none":
        ref_adapter = None
        if cfg.objective.ref_adapter_path:
            from ftcore.peft.reference import load_reference_adapter

            ref_adapter = load_reference_adapter(chunks, cfg, cfg.objective.ref_adapter_path)
        return Reference(ref_adapter=ref_adapter, policy=list(chunks))
    if precompute:
        return Reference()
    from ftcore.models.builder import build_model
    from ftcore.models.sharding import iter_params

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # building draws nothing the run would see
        copy = build_model(cfg, init=False)
    with torch.no_grad():
        own = dict(iter_params(chunks))
        for name, p in iter_params(copy):
            p.copy_(own[name])
            p.requires_grad_(False)
    return Reference(chunks=copy)


class _CpSum(torch.autograd.Function):
    """Sum over the CP group; the gradient passes through (each rank's tokens get theirs)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        collectives.all_reduce(x, group=ps.get_context_parallel_group())
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def pair_sums(whole, mb, vocab_size: int, rows, output: torch.Tensor):
    """[pairs, 2] sequence log-probs (summed over the CP group) and completion token counts."""
    dev = output.device
    labels = to_device(mb.labels, dev)
    index, side = to_device(mb.pair_index, dev), to_device(mb.pair_side, dev)
    if rows is not None:
        labels, index = target_logits.at_rows(labels, rows), target_logits.at_rows(index, rows)
        side = target_logits.at_rows(side, rows)
    logps = -token_losses(output, labels, vocab_size)
    sums, counts = preference.sequence_sums(logps, index, side, whole.num_pairs)
    if ps.get_context_parallel_world_size() > 1:
        sums = _CpSum.apply(sums)
        collectives.all_reduce(counts, group=ps.get_context_parallel_group())
    return sums, counts


def _reference_loss(store: dict, whole, mb, vocab_size: int, rows):
    def loss(output):
        with cpu.mode_suspended():
            sums, _ = pair_sums(whole, mb, vocab_size, rows, output)
            store[id(whole)] = sums.detach()
            zero = output.new_zeros(())
            return zero, torch.tensor(0, dtype=torch.int), {}

    return loss


def reference_step(cfg, store: dict):
    """The schedule's step for a reference forward (under no_grad): forward_step storing each
    micro-batch's pair sums in `store`, then the FP8 delayed-scaling update TE's autocast exit
    skips without grad (precision/delayed.py; a no-op for other recipes)."""
    step = partial(forward_step, make_loss=partial(_reference_loss, store))

    def run(*args, **kwargs):
        out = step(*args, **kwargs)
        delayed.update_after_no_grad_forward(cfg)
        return out

    return run


def _policy_loss(obj, store: dict, whole, mb, vocab_size: int, rows):
    def loss(output):
        with cpu.mode_suspended():
            sums, counts = pair_sums(whole, mb, vocab_size, rows, output)
            ref = store.pop(id(whole)).to(sums.device, sums.dtype)
            losses = preference.pair_losses(obj, sums, ref, counts)
            first = ps.get_context_parallel_rank() == 0  # the CP ranks hold the same sums
            pairs = len(losses) if first else 0
            stats = torch.cat([
                # new_full fills on the device; new_tensor would copy from the host and wait
                torch.stack([losses.detach().sum(), losses.new_full((), float(pairs)),
                             counts.sum()]),
                preference.metric_sums(obj, sums, ref),
            ]) * float(first)  # fmt: skip
            return losses.sum(), torch.tensor(pairs, dtype=torch.int), {"dpo": stats}

    return loss


@dataclass(frozen=True)
class PairResult:
    loss: float  # mean over pairs
    pairs: int
    tokens: int  # completion tokens (chosen and rejected)
    metrics: dict  # preference.METRICS, means over pairs


def run_pairs(state, microbatches: list, *, forward_only: bool, timers=None) -> PairResult:
    """The reference pass, then the policy's; the loss and metrics over the world."""
    ref: Reference = state.extra["reference"]
    obj = preference.Objective.of(state.cfg)
    store: dict = {}
    if ref.tables is not None:  # objective.precompute_ref: no reference forward
        dev = rdist.comm_device()  # the model's device (cuda:<local rank>, or the CPU)
        store = {id(mb): ref.stored(mb, dev) for mb in microbatches}
    else:
        with torch.no_grad(), ref.context():
            step = reference_step(state.cfg, store)
            schedule(state, microbatches, forward_only=True, step=step, model=ref.chunks)
    step = partial(forward_step, make_loss=partial(_policy_loss, obj, store))
    out = schedule(state, microbatches, forward_only=forward_only, timers=timers, step=step)
    # per micro-batch: loss sum, pairs, completion tokens, then preference.METRICS' sums
    width = 3 + len(preference.METRICS)
    local = torch.stack([o["dpo"] for o in out]).sum(0).tolist() if out else [0.0] * width
    total = reduce_sums(local, is_loss_rank())
    loss_sum, pairs, tokens, sums = total[0], total[1], total[2], total[3:]
    means = preference.means(loss_sum, pairs, sums)
    return PairResult(loss=means.pop("loss"), pairs=int(pairs), tokens=int(tokens), metrics=means)
