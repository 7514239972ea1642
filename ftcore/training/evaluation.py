"""The one evaluation loop: training's validation loss (metrics.jsonl `eval_loss`), `ftcore.eval`
and the benchmarks' eval loss all come from `evaluate`.

The loss is the token-weighted mean next-token cross entropy over the given global batches: each
batch's loss sum and target-token count are summed over the whole world (step.run_batches), and
the mean is their ratio, so every target token weighs the same whatever the layout (TP, PP, DP,
micro-batching, packing) and every rank returns the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state as ps

from ftcore.data.pipeline import build_val_batches
from ftcore.training.step import run_batches


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
    back in training mode after."""
    for chunk in state.model:
        chunk.eval()
    total, tokens = 0.0, 0.0
    try:
        with torch.no_grad():
            if state.cfg.objective.name == "dpo":
                return _evaluate_pairs(state, batches)
            for microbatches in batches:
                s, n = run_batches(state, microbatches, forward_only=True)
                total, tokens = total + s, tokens + n
    finally:
        for chunk in state.model:
            chunk.train()
    return EvalResult(loss=total / max(tokens, 1.0), tokens=int(tokens))


def _evaluate_pairs(state, batches: list) -> EvalResult:
    """objective=dpo: every value a mean over the pairs of all batches."""
    from ftcore.training.dpo import run_pairs

    pairs, tokens, sums = 0, 0, {}
    for microbatches in batches:
        r = run_pairs(state, microbatches, forward_only=True)
        pairs, tokens = pairs + r.pairs, tokens + r.tokens
        for k, v in {"loss": r.loss, **r.metrics}.items():
            sums[k] = sums.get(k, 0.0) + v * r.pairs
    means = {k: v / max(pairs, 1) for k, v in sums.items()}
    return EvalResult(loss=means.pop("loss", 0.0), tokens=tokens, pairs=pairs, metrics=means)
