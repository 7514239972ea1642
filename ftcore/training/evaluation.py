"""The one evaluation loop: training's validation loss (metrics.jsonl `eval_loss`), `ftcore.eval`
and the benchmarks' eval loss all come from `evaluate`.

The loss is the token-weighted mean next-token cross entropy over the given global batches: each
batch's loss sum and target-token count are summed over the whole world (step.run_batches), and
the mean is their ratio, so every target token weighs the same whatever the layout (TP, PP, DP,
micro-batching, packing) and every rank returns the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps

from ftcore.data.pipeline import build_val_batches
from ftcore.training.step import run_batches


@dataclass(frozen=True)
class EvalResult:
    loss: float  # loss sum / target tokens (0.0 when there are none)
    tokens: int  # target tokens, over the world


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
            for microbatches in batches:
                s, n = run_batches(state, microbatches, forward_only=True)
                total, tokens = total + s, tokens + n
    finally:
        for chunk in state.model:
            chunk.train()
    return EvalResult(loss=total / max(tokens, 1.0), tokens=int(tokens))
