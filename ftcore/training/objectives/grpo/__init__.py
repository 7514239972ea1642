"""objective=grpo: Group Relative Policy Optimization, as TRL 1.16's GRPOTrainer defines it, with
the rollouts sampled by ftcore's own KV-cache decoder on the training layout (docs/grpo.md). The
room:

- data: prompt-only records, data.format=prompt (data/prompt_set.py tokenizes them as TRL), the
  other columns handed to the reward functions (data/rewards.py: built-ins, or the user's
  `module:function`, the one place ftcore runs code it did not ship);
- checks: validation/grpo_checks.py (TRL's loss names, whole groups, the decoder's layouts);
- reference: the starting policy (beta != 0 only): LoRA's base with the adapters off or the
  starting adapter swapped in, full fine-tuning DPO's frozen copy (step.build_reference);
- a step: rollout.py (prompts, completions, rewards, advantages), step.py (the forward-only
  passes once per rollout, then the update), loss.py (TRL's advantages, loss, metrics);
- metrics: TRL's `reward`, `rewards/NAME/*`, `reward_std`, `frac_reward_zero_std`, `kl`,
  `entropy`, `clip_ratio/*`, `completions/*`; `rollout_time_s` and `update_time_s` apart;
- planner: planner/grpo.py prices the rollout, the passes and the update apart.
"""

from __future__ import annotations

from ftcore.data import rewards
from ftcore.data.prompt_set import build_prompt_loader
from ftcore.training.objectives.base import Objective, StepResult
from ftcore.training.objectives.grpo import loss, step


class Grpo(Objective):
    name = "grpo"
    data_format = "prompt"
    unit = "completions"
    metrics = (*loss.TOKEN_METRICS, "clip_ratio/low_min", "clip_ratio/high_max", "reward",
               "reward_std", "frac_reward_zero_std", "completions/mean_length",
               "completions/clipped_ratio")  # fmt: skip

    def build(self, state, chunks: list, *, training: bool, data: bool) -> None:
        state.extra["reference"] = step.build_reference(state.cfg, chunks)
        state.extra["grpo_rewards"] = rewards.build(state.cfg)

    def loader(self, state, dp_rank: int, dp: int):
        return build_prompt_loader(state.cfg, state.tokenizer, rewards.columns_needed(state.cfg))

    def batch(self, state, timers=None) -> tuple[list, dict]:
        """A rollout when one is due: its sampling and scoring apart (`rollout_time_s`), its
        forward-only passes counted with the update."""
        batch, sampled, passes = step.next_batch(state)
        return batch.microbatches, {"rollout_time_s": sampled, "update_time_s": passes}

    def run(self, state, microbatches: list, *, forward_only: bool, timers=None) -> StepResult:
        batch = state.extra["grpo_batch"]
        r = step.run(state, batch, forward_only=forward_only, timers=timers)
        metrics = dict(r.metrics)
        if batch.uses == 1:  # the rollout's metrics on the step that sampled it (as TRL logs them)
            metrics.update(batch.metrics)
        n = state.cfg.train.global_batch_size
        return StepResult(loss=r.loss, tokens=r.tokens, count=n, metrics=metrics)
