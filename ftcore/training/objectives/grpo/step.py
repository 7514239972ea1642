"""One objective=grpo step (docs/grpo.md): a rollout when one is due (rollout.py), the
forward-only passes it needs once, then the policy's forward and backward with GRPO's loss
(loss.py).

A rollout serves objective.num_iterations updates. With more than one, the rollout policy's
per-token log-probs are kept from a forward pass right after sampling (TRL's
`old_per_token_logps`); with one, the ratio is exp(l - l.detach()) = 1. With beta != 0 the
reference's log-probs come from one forward pass per rollout, as DPO's reference does (LoRA: the
adapters off, or the adapter the run started from swapped in, TRL's "ref" copy; full fine-tuning:
a frozen copy sharded like the policy). Every pass goes through megatron's schedule, so the values
arrive on the last pipeline stage at every layout, stored there per micro-batch. Log-probs and
the entropy are those of the logits divided by objective.temperature, as TRL's. Per-token
log-probs are -(vocab-parallel cross entropy), reduced over TP (step.token_losses).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ftcore.data.transfer import to_device
from ftcore.models import target_logits
from ftcore.runtime import collectives, cpu
from ftcore.runtime import dist as rdist
from ftcore.training.objectives.dpo.step import Reference
from ftcore.training.objectives.dpo.step import build_reference as frozen_copy
from ftcore.training.objectives.grpo import loss as grpo_loss
from ftcore.training.objectives.grpo import rollout
from ftcore.training.step import (
    forward_step,
    is_loss_rank,
    mask_padded_vocab,
    reduce_sums,
    schedule,
    token_losses,
)

log = logging.getLogger("ftcore")


def build_reference(cfg, chunks: list):
    """Before DDP and resume (trainer.setup): None with beta=0 (no KL term); LoRA: the adapters
    off, or with peft.adapter_path the starting adapter's values (TRL copies a pretrained adapter
    to "ref"); full fine-tuning: DPO's frozen copy of the starting weights."""
    if cfg.objective.beta == 0.0:
        return None
    if cfg.peft.name != "none":
        from ftcore.peft.reference import snapshot

        start = snapshot(chunks) if cfg.peft.adapter_path else None
        return Reference(ref_adapter=start, policy=list(chunks))
    return frozen_copy(cfg, chunks)


@torch.no_grad()
def entropies(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-position entropy of the softmax of vocab-parallel logits [..., v/tp] (padded vocab
    out), reduced over TP."""
    z = mask_padded_vocab(logits.float(), vocab_size)
    m = z.max(-1).values
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    if tp > 1:
        collectives.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m.unsqueeze(-1))
    sums = torch.stack([e.sum(-1), torch.where(e > 0, e * z, torch.zeros_like(z)).sum(-1)])
    if tp > 1:
        collectives.all_reduce(sums, group=group)
    return m + torch.log(sums[0]) - sums[1] / sums[0]


def _targets(batch, whole, mb, rows, output):
    """labels and each target's row, at the positions the logits were computed at."""
    dev = output.device
    labels, seq = to_device(mb.labels, dev), to_device(batch.seq[id(whole)], dev)
    if rows is not None:
        labels, seq = target_logits.at_rows(labels, rows), target_logits.at_rows(seq, rows)
    return labels, seq


def _store_loss(store: dict, temperature: float, batch, whole, mb, vocab: int, rows):
    """A forward-only pass's loss: keeps the per-token log-probs of the micro-batch."""

    def loss(output):
        with cpu.mode_suspended():
            labels, _ = _targets(batch, whole, mb, rows, output)
            store[id(whole)] = (-token_losses(output.float() / temperature, labels, vocab)).detach()
            return output.new_zeros(()), torch.tensor(0, dtype=torch.int), {}

    return loss


def _logps_pass(state, batch, store: dict, ref=None) -> None:
    """Per-token log-probs of every micro-batch of the rollout, by the policy (ref None) or the
    reference, stored on the last stage."""
    s = grpo_loss.Settings.of(state.cfg)
    make = partial(_store_loss, store, s.temperature, batch)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        with ref.context() if ref is not None else contextlib.nullcontext():
            schedule(state, batch.microbatches, forward_only=True,
                     step=partial(forward_step, make_loss=make),
                     model=ref.chunks if ref is not None else None)  # fmt: skip


def _policy_loss(s: grpo_loss.Settings, batch, whole, mb, vocab: int, rows):
    def loss(output):
        with cpu.mode_suspended():
            labels, seq = _targets(batch, whole, mb, rows, output)
            logits = output.float() / s.temperature
            entropy = entropies(logits.detach(), vocab)  # before the cross entropy, in place
            logps = -token_losses(logits, labels, vocab)
            adv = batch.row_adv[id(whole)].to(logps.device)[seq.clamp(min=0)]
            old = batch.old.get(id(whole))
            old = logps.detach() if old is None else old.to(logps.device)
            ref = batch.ref.get(id(whole))
            ref = ref.to(logps.device) if ref is not None else None
            per_token, ratio, kl = grpo_loss.token_losses(s, logps, old, ref, adv)
            n = whole.tokens.shape[0]
            loss_sum, count = grpo_loss.aggregate(s, per_token, seq, n)
            count = torch.as_tensor(count, dtype=torch.int)
            stats = torch.cat([
                torch.stack([loss_sum.detach().double(), count.double().to(loss_sum.device)]),
                grpo_loss.metric_sums(s, ratio.detach(), kl, entropy, adv, seq, n),
            ])  # fmt: skip
            return loss_sum, count, {"grpo": stats}

    return loss


@dataclass(frozen=True)
class UpdateResult:
    loss: float
    tokens: int  # completion tokens trained on (the global batch)
    metrics: dict  # TRL's names: the update's and, on a rollout step, the rollout's


def next_batch(state) -> tuple[rollout.Batch, float, float]:
    """The rollout this step trains on (a new one every num_iterations steps), the seconds spent
    sampling and scoring it, and those of its forward-only passes (old and reference log-probs)."""
    cfg = state.cfg
    s = grpo_loss.Settings.of(cfg)
    batch = state.extra.get("grpo_batch")
    if batch is not None and batch.uses < s.num_iterations:
        return batch, 0.0, 0.0
    t0 = time.perf_counter()
    batch = rollout.rollout(state, state.step // s.num_iterations)
    t1 = time.perf_counter()
    if s.num_iterations > 1:  # the rollout policy's log-probs, kept for every update
        _logps_pass(state, batch, batch.old)
    ref = state.extra.get("reference")
    if ref is not None:
        _logps_pass(state, batch, batch.ref, ref)
    state.extra["grpo_batch"] = batch
    return batch, t1 - t0, time.perf_counter() - t1


def run(state, batch: rollout.Batch, *, forward_only: bool = False, timers=None) -> UpdateResult:
    """The policy's forward (and backward) over the rollout's micro-batches: GRPO's loss and the
    update's metrics over the world."""
    s = grpo_loss.Settings.of(state.cfg)
    step = partial(forward_step, make_loss=partial(_policy_loss, s, batch))
    out = schedule(state, batch.microbatches, forward_only=forward_only, timers=timers, step=step)
    batch.uses += 1
    width = 2 + len(grpo_loss.TOKEN_METRICS) + 1
    if out:
        rows = torch.stack([o["grpo"] for o in out]).cpu()
        local = rows[:, :width].sum(0).tolist()
        low_min, high_max = rows[:, width].min().item(), rows[:, width + 1].max().item()
    else:
        local, low_min, high_max = [0.0] * width, float("inf"), float("-inf")
    total = reduce_sums(local, is_loss_rank())
    low_min, high_max = _extremes(low_min, high_max)
    loss_sum, count, sums = total[0], total[1], total[2:]
    metrics = grpo_loss.metric_means(s, sums, low_min, high_max)
    tokens = int(sums[-1])
    return UpdateResult(loss=loss_sum / max(count, 1.0), tokens=tokens, metrics=metrics)


def _extremes(low_min: float, high_max: float) -> tuple[float, float]:
    """The world's smallest low_min and largest high_max (ranks without a loss hold inf, -inf)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return low_min, high_max
    t = torch.tensor([low_min, -high_max], dtype=torch.float64, device=rdist.comm_device())
    collectives.all_reduce(t, op=dist.ReduceOp.MIN)
    return t[0].item(), -t[1].item()
