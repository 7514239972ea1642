"""The one evaluation loop: training's validation loss (metrics.jsonl `eval_loss`), `ftcore.eval`
and the benchmarks' eval loss all come from `evaluate`.

The loss is the objective's (training/objectives/): for SFT the token-weighted mean next-token cross
entropy over the given global batches (each batch's loss sum and target-token count are summed
over the whole world, step.run_batches, so every target token weighs the same whatever the layout:
TP, PP, DP, micro-batching, packing), for DPO the mean over the pairs of all batches; every rank
returns the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state as ps

from ftcore.data.pipeline import build_val_batches
from ftcore.training import objectives


@dataclass(frozen=True)
class EvalResult:
    loss: float  # loss sum / target tokens (0.0 when there are none)
    tokens: int  # target tokens, over the world
    # objective=dpo: loss is the mean over `pairs`, and so is each of rewards/*, logps/*
    pairs: int = 0
    metrics: dict = field(default_factory=dict)


def held_out_batches(state, path: str | None = None) -> list:
    """This DP rank's share of the validation batches: the held-out split of data.path, or all of
    `path` (ftcore.eval's data)."""
    rank = ps.get_data_parallel_rank()
    return build_val_batches(state.cfg, state.tokenizer, rank, state.dp, path=path)


def evaluate(state, batches: list) -> EvalResult:
    """Forward only over `batches` (each a list of micro-batches), the model in eval mode and put
    back in training mode after. Each batch's loss is a mean over what its objective counts
    (target tokens, pairs: objectives/base.py), so the batches are weighed by those counts."""
    objective = state.extra.get("objective") or objectives.of(state.cfg)
    for chunk in state.model:
        chunk.eval()
    count, tokens, sums = 0.0, 0, {}
    try:
        with torch.no_grad():
            for microbatches in batches:
                r = objective.run(state, microbatches, forward_only=True)
                count, tokens = count + r.count, tokens + r.tokens
                for k, v in {"loss": r.loss, **r.metrics}.items():
                    sums[k] = sums.get(k, 0.0) + v * r.count
    finally:
        for chunk in state.model:
            chunk.train()
    means = {k: v / max(count, 1.0) for k, v in sums.items()}
    pairs = int(count) if objective.unit == "pairs" else 0
    return EvalResult(loss=means.pop("loss", 0.0), tokens=tokens, pairs=pairs, metrics=means)
