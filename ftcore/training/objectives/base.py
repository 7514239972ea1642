"""What an objective is to the trainer: the one interface SFT, DPO and GRPO each fill in, in its
own room (objectives/sft.py, objectives/dpo/, objectives/grpo/).

An objective says
- what data it trains on (`data_format`: the records' shape, read by the data layer's reader for
  it: data/preference.py, data/prompt_set.py; None for SFT's formats);
- what it changes in the configuration before the checks (`prepare`), what it needs before the
  model is wrapped (`build`: a reference, reward functions) and around the restore of a
  checkpoint (`before_resume`, `after_resume`);
- where a step's micro-batches come from (`batch`: the data stream, or a rollout);
- how a step's micro-batches become a loss and metrics (`run`, the forward and, in training, the
  backward through megatron's schedule), and the names of those metrics (`metrics`: TRL's).

Its configuration rules are checked before anything is built, torch-free, in the validation layer
(validation/objective.py, validation/grpo_checks.py), and its planner terms live in the planner
(planner/activations.py's DPO reference pass, planner/grpo.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftcore.training.timing import DATA, timed


@dataclass(frozen=True)
class StepResult:
    """One global batch through `run`: values over the whole world, the same on every rank."""

    loss: float  # the objective's loss of the batch (a mean over `count` of `Objective.unit`)
    tokens: int  # the tokens the loss is taken over (target, completion)
    count: float  # what `loss` is a mean over: target tokens (sft), pairs (dpo), completions (grpo)
    metrics: dict = field(default_factory=dict)  # `Objective.metrics`' values


class Objective:
    """The default of every hook: SFT's (the data stream, no reference, no extra metric)."""

    name = "sft"
    data_format: str | None = None
    unit = "tokens"  # what a loss is a mean over (StepResult.count)
    metrics: tuple[str, ...] = ()

    def prepare(self, cfg) -> None:
        """Defaults one setting implies for another, before the checks (trainer.setup step 1)."""

    def build(self, state, chunks: list, *, training: bool, data: bool) -> None:
        """Before DDP and resume (trainer.setup step 8): what the objective keeps in state.extra."""

    def loader(self, state, dp_rank: int, dp: int):
        """This rank's training stream, or None for the data pipeline's (data/pipeline.py)."""
        return None

    def before_resume(self, state, *, training: bool, data: bool) -> None:
        """Once the optimizer exists, before a checkpoint is restored (the starting weights)."""

    def after_resume(self, state, *, training: bool, data: bool) -> None:
        """Once nothing can refuse the run any more (before its directory is written)."""

    def batch(self, state, timers=None) -> tuple[list, dict]:
        """The step's micro-batches of this rank, and seconds to log (`update_time_s`: what of the
        update ran here; the trainer adds the rest of the step's)."""
        with timed(timers, DATA):
            return state.loader.next_microbatches(), {}

    def run(self, state, microbatches: list, *, forward_only: bool, timers=None) -> StepResult:
        raise NotImplementedError
