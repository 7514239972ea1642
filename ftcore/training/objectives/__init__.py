"""The objectives a run can train with, one room each (base.py: the interface the trainer calls):

- sft.py: next-token cross entropy (supervised fine-tuning);
- dpo/: Direct Preference Optimization on preference pairs, as TRL 1.x (docs/preference.md);
- grpo/: Group Relative Policy Optimization on prompts, rollouts by ftcore's own decoder, as
  TRL 1.16 (docs/grpo.md).
"""

from __future__ import annotations

from ftcore.training.objectives.base import Objective, StepResult
from ftcore.training.objectives.dpo import Dpo
from ftcore.training.objectives.grpo import Grpo
from ftcore.training.objectives.sft import Sft

__all__ = ["Objective", "StepResult", "of"]
OBJECTIVES = {o.name: o for o in (Sft, Dpo, Grpo)}


def of(cfg) -> Objective:
    """The objective `objective.name` names (validation/objective.py checked the name)."""
    return OBJECTIVES[cfg.objective.name]()
