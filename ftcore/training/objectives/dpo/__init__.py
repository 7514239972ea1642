"""objective=dpo: Direct Preference Optimization, as TRL 1.x's DPOTrainer defines it
(docs/preference.md). The room:

- data: preference pairs, data.format=preference (data/preference.py tokenizes them as TRL;
  data/samples.py keeps a pair's two sequences together);
- checks: validation/objective.py (TRL's loss names, label_smoothing, the reference);
- reference: LoRA's base with the adapters off or a reference adapter swapped in
  (peft/reference.py), full fine-tuning's frozen copy, or log-probs stored by a first pass
  (ref_store.py, objective.precompute_ref);
- a step: step.py (the reference's forward, then the policy's, through megatron's schedule),
  its losses and metrics loss.py; metrics `rewards/*`, `logps/*` (TRL's), means over pairs.
"""

from __future__ import annotations

import logging

from ftcore.training.objectives.base import Objective, StepResult
from ftcore.training.objectives.dpo import loss, ref_store, step

log = logging.getLogger("ftcore")


class Dpo(Objective):
    name = "dpo"
    data_format = "preference"
    unit = "pairs"
    metrics = loss.METRICS

    def prepare(self, cfg) -> None:
        o = cfg.objective
        if o.ref_adapter_path and not cfg.peft.adapter_path:
            cfg.peft.adapter_path = o.ref_adapter_path  # the policy starts as the reference (TRL)

    def build(self, state, chunks: list, *, training: bool, data: bool) -> None:
        precompute = state.cfg.objective.precompute_ref and training and data
        state.extra["reference"] = step.build_reference(state.cfg, chunks, precompute)
        if state.info.rank == 0:
            log.info("DPO reference: %s", _reference_said(state.cfg, precompute))

    def before_resume(self, state, *, training: bool, data: bool) -> None:
        if state.cfg.objective.precompute_ref and training and data:
            ref_store.attach(state)  # the starting weights' log-probs, before a restore

    def after_resume(self, state, *, training: bool, data: bool) -> None:
        if state.cfg.objective.precompute_ref and training and data:
            ref_store.save(state)  # the stored first pass, now that nothing can refuse the run

    def run(self, state, microbatches: list, *, forward_only: bool, timers=None) -> StepResult:
        r = step.run_pairs(state, microbatches, forward_only=forward_only, timers=timers)
        return StepResult(loss=r.loss, tokens=r.tokens, count=r.pairs, metrics=r.metrics)


def _reference_said(cfg, precompute: bool) -> str:
    if precompute:
        return "the starting weights' log-probs, stored by a first pass (objective.precompute_ref)"
    if cfg.peft.name == "none":
        return "a frozen copy of the starting weights"
    ref = cfg.objective.ref_adapter_path
    if ref:
        return f"the base plus objective.ref_adapter_path={ref} (loaded; the policy starts from it)"
    return "the base with the adapters off"
