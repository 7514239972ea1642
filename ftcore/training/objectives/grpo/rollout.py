"""objective=grpo's rollout (docs/grpo.md): the prompts of a step, num_generations completions for
each sampled by ftcore's own KV-cache decoder on the training layout, their rewards and advantages,
and the micro-batches the update trains on.

A step's global batch is train.global_batch_size completions, num_generations consecutive ones per
prompt (TRL's order). DP rank r decodes its contiguous slice of them on its own model replica; no
second copy of the weights exists. Completion k of rollout t samples from a generator seeded
from (run.seed, t, k) alone, which draws once per token it takes (inference/generation.py), so
the same seed gives the same completions at every layout. A completion keeps its stop token, as
TRL's does; one that reaches max_completion_length without it is truncated.

The rewards are computed once per completion, by the rank of each replica that holds its data
(pipeline stage 0, TP rank 0), and summed over the world (the others add zeros), so every rank
holds the whole batch's rewards, computes the same group advantages, and a reward function that
fails stops every rank with its message (exit 2).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ftcore.data import rewards as rewards_mod
from ftcore.data.packing import MicroBatch, make_microbatch
from ftcore.data.pipeline import row_width, trim_multiple
from ftcore.data.prompt_set import is_conversational
from ftcore.data.templates import Doc
from ftcore.data.transfer import pin_host_batches
from ftcore.errors import FtcoreError
from ftcore.runtime import collectives
from ftcore.runtime import dist as rdist
from ftcore.training.objectives.grpo import loss as grpo_loss
from ftcore.training.step import is_data_rank

log = logging.getLogger("ftcore")


@dataclass
class Batch:
    """One rollout: this rank's completions and micro-batches, and what the whole batch scored."""

    index: int  # rollout t (its seeds)
    prompt_ids: list[list[int]]  # this rank's rows
    completion_ids: list[list[int]]
    truncated: list[bool]
    advantages: torch.Tensor  # [rows of this rank]
    microbatches: list[MicroBatch] = field(default_factory=list)
    seq: dict = field(default_factory=dict)  # id(mb) -> [b, s] row of each target, -1 elsewhere
    row_adv: dict = field(default_factory=dict)  # id(mb) -> [b] advantages
    old: dict = field(default_factory=dict)  # id(mb) -> the rollout policy's log-probs
    ref: dict = field(default_factory=dict)  # id(mb) -> the reference's log-probs
    metrics: dict = field(default_factory=dict)  # reward*, completions/* (the whole batch)
    rewards: list[float] = field(default_factory=list)  # the whole batch's (rank-order)
    completions: list = field(default_factory=list)  # this rank's decoded completions
    uses: int = 0  # updates made with it so far (objective.num_iterations)


def row_seed(seed: int, rollout: int, row: int) -> int:
    """The sampling seed of completion `row` of rollout `rollout`: a function of the three alone."""
    return int(np.random.SeedSequence([seed, 55, rollout, row]).generate_state(1)[0])


def my_rows(cfg) -> range:
    """This DP rank's rows of the global batch (contiguous, as the training data's)."""
    per = cfg.train.global_batch_size // ps.get_data_parallel_world_size()
    r = ps.get_data_parallel_rank()
    return range(r * per, (r + 1) * per)


def sample(state, prompt_rows: list[list[int]], rows: range, index: int) -> list[list[int]]:
    """Completion ids (stop token kept) of this replica's rows, decoded on its own layout."""
    from ftcore.inference.generation import generate_ids, stop_ids
    from ftcore.models.builder import params_current

    cfg, tok = state.cfg, state.tokenizer
    o = cfg.objective
    params_current(state.model)  # the last update, before the decoder reads the weights
    # each replica decodes its own rows: the chooser shares with its model-parallel group only
    group = ps.get_model_parallel_group() if ps.get_data_parallel_world_size() > 1 else None
    seeds = [row_seed(cfg.run.seed, index, k) for k in rows]
    return generate_ids(state, prompt_rows, max_new_tokens=o.max_completion_length,
                        temperature=o.temperature, top_k=o.top_k, top_p=o.top_p,
                        stop=stop_ids(tok), pad_id=tok.pad_token_id or 0, seeds=seeds,
                        group=group, keep_stop=True)  # fmt: skip


def _decode(tokenizer, ids: list[int], prompt) -> object:
    """A completion as TRL hands it to the rewards: its text without special tokens, or for a
    conversational prompt one assistant message."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return [{"role": "assistant", "content": text}] if is_conversational(prompt) else text


def _score_rows(state, funcs, prompts, completions, ids, columns) -> tuple[list[list[float]], str]:
    """This rank's [rows][functions] rewards, or NaNs and the error of a failing function."""
    try:
        return rewards_mod.score(funcs, prompts, completions, ids, columns), ""
    except Exception as e:  # noqa: BLE001 - the user's code: every rank must learn that it failed
        msg = str(e) if isinstance(e, FtcoreError) else f"{type(e).__name__}: {e}"
        return [[math.nan] * len(funcs) for _ in completions], msg


def _gather(state, rows: range, table: list[list[float]], extra: list[list[float]], error: str):
    """The whole batch's [N, F + extra] values, summed over the world from each replica's data
    rank (the others add zeros); raises on every rank when a data rank's rewards failed."""
    n = state.cfg.train.global_batch_size
    width = (len(table[0]) if table else 0) + len(extra[0]) + 1
    t = torch.zeros(n, width, dtype=torch.float64)
    if is_data_rank():
        for j, k in enumerate(rows):
            t[k, :-1] = torch.tensor(table[j] + extra[j], dtype=torch.float64)
            t[k, -1] = 1.0 if error else 0.0
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = t.to(rdist.comm_device())
        collectives.all_reduce(t)
        t = t.cpu()
    if t[:, -1].any():
        raise FtcoreError(f"a reward function failed: {error or 'on another rank'}",
                          field="objective.rewards", fix="fix the reward function (docs/grpo.md)")  # fmt: skip
    return t[:, :-1]


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict:
    """TRL's completions/* metrics of the whole batch."""
    lengths = lengths.float()
    term = lengths[~truncated]
    term = term if len(term) else torch.zeros(1)
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": term.mean().item(),
        "completions/min_terminated_length": term.min().item(),
        "completions/max_terminated_length": term.max().item(),
    }


def microbatches(
    cfg, prompt_ids, completion_ids, truncated, adv: torch.Tensor, pad_id: int, batch: Batch
):
    """This rank's rows as micro-batches: prompt + completion, the completion tokens the targets
    (none for a truncated one with mask_truncated_completions), each micro-batch as wide as its
    longest row (under PP all of them as the widest: one shape per step)."""
    mbs = cfg.train.micro_batch_size
    mask_cut = cfg.objective.mask_truncated_completions
    docs = []
    for p, c, cut in zip(prompt_ids, completion_ids, truncated):
        ids = np.asarray(p + c, np.int32)
        targets = np.zeros(len(ids), bool)
        if not (mask_cut and cut):
            targets[len(p) :] = True
        docs.append(Doc(ids, targets))
    groups = [docs[i : i + mbs] for i in range(0, len(docs), mbs)]
    multiple = trim_multiple(cfg)
    widths = [row_width([[d] for d in g], cfg.data.seq_len, multiple) for g in groups]
    if cfg.parallel.pp > 1:
        widths = [max(widths)] * len(widths)
    pin = pin_host_batches(cfg.cluster.device)  # as the loader's: copies to the GPU need no sync
    for k, (g, w) in enumerate(zip(groups, widths)):
        mb = make_microbatch([[d] for d in g], w, pad_id)
        mb = mb.pin_memory() if pin else mb
        rows = torch.arange(len(g)).unsqueeze(1).expand(len(g), w)
        seq = torch.where(mb.loss_mask > 0, rows, torch.full_like(rows, -1))
        batch.seq[id(mb)] = seq.pin_memory() if pin else seq
        batch.row_adv[id(mb)] = adv[k * mbs : k * mbs + len(g)].clone()
        batch.microbatches.append(mb)


def rollout(state, index: int) -> Batch:
    """Rollout `index`: prompts, completions, rewards, advantages, micro-batches (no forward pass
    of the update yet: step.py adds the old and reference log-probs)."""
    cfg, tok = state.cfg, state.tokenizer
    s = grpo_loss.Settings.of(cfg)
    funcs = state.extra["grpo_rewards"]
    loader = state.loader
    picked = loader.next_prompts()
    g = s.num_generations
    rows = my_rows(cfg)
    prompts = [loader.prompts[picked[k // g]] for k in rows]
    completion_ids = sample(state, [p.ids for p in prompts], rows, index)
    stop = _stop_and_pad(tok)
    truncated = [not ids or ids[-1] not in stop for ids in completion_ids]
    completions = [_decode(tok, ids, p.prompt) for ids, p in zip(completion_ids, prompts)]
    table, error = [], ""
    if is_data_rank():
        names = sorted({k for p in prompts for k in p.columns})
        columns = {k: [p.columns.get(k) for p in prompts] for k in names}
        table, error = _score_rows(state, funcs, [p.prompt for p in prompts], completions,
                                   completion_ids, columns)  # fmt: skip
    else:
        table = [[0.0] * len(funcs) for _ in rows]
    extra = [[float(len(c)), float(t)] for c, t in zip(completion_ids, truncated)]
    whole = _gather(state, rows, table, extra, error)
    f = len(funcs)
    weights = torch.tensor([r.weight for r in funcs])
    scored = grpo_loss.advantages(whole[:, :f], weights, [r.name for r in funcs], s)
    metrics = {**completion_metrics(whole[:, f], whole[:, f + 1] > 0), **scored.metrics}
    adv = scored.advantages[rows.start : rows.stop]
    batch = Batch(index, [p.ids for p in prompts], completion_ids, truncated, adv,
                  metrics=metrics, rewards=scored.rewards.tolist(), completions=completions)  # fmt: skip
    microbatches(
        cfg, batch.prompt_ids, completion_ids, truncated, adv, tok.pad_token_id or 0, batch
    )
    return batch


def _stop_and_pad(tokenizer) -> set[int]:
    """What ends a completion without truncating it: the stop tokens and the pad (TRL's
    `eos_and_pad`)."""
    from ftcore.inference.generation import stop_ids

    pad = tokenizer.pad_token_id
    return stop_ids(tokenizer) | ({pad} if pad is not None else set())
