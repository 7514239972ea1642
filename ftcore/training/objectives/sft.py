"""Supervised fine-tuning: next-token cross entropy over the loss-masked tokens (data.format
instruction, chat, prompt_completion or text; data/templates.py renders them).

The loss of a global batch is the sum of the target tokens' cross entropies over their number,
both summed over the world (training/step.py: `loss_func`, `run_batches`), so micro-batching, DP,
packing and every layout leave it unchanged. A mixture of experts scales its auxiliary losses to
the step's target tokens (training/moe_metrics.py).
"""

from __future__ import annotations

from contextlib import nullcontext

from ftcore.training import moe_metrics
from ftcore.training.objectives.base import Objective, StepResult
from ftcore.training.step import is_data_rank, run_batches


class Sft(Objective):
    name = "sft"

    def run(self, state, microbatches: list, *, forward_only: bool, timers=None) -> StepResult:
        moe = not forward_only and moe_metrics.is_moe(state.model)
        scaled = (
            moe_metrics.scaled_step(state, microbatches, is_data_rank()) if moe else nullcontext()
        )
        with scaled:
            loss_sum, tokens = run_batches(
                state, microbatches, forward_only=forward_only, timers=timers
            )
        return StepResult(loss=loss_sum / max(tokens, 1.0), tokens=int(tokens), count=tokens)
