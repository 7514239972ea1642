"""Reward functions the GRPO tests name as `module:function` (objective.rewards), in TRL's
signature, so ftcore and TRL's GRPOTrainer score completions with the same code."""

from __future__ import annotations


def length_reward(completions, completion_ids, **columns) -> list[float]:
    """Longer completions score higher (a spread of values within every group)."""
    return [float(len(ids)) for ids in completion_ids]


def picky_reward(completions, completion_ids, answer, **columns) -> list[float | None]:
    """The first token's residue against the record's answer; None (unscored) for some."""
    return [None if ids[0] % 5 == 0 else float(ids[0] % 3 == int(a) % 3)
            for ids, a in zip(completion_ids, answer)]  # fmt: skip


def token_sum_reward(completions, completion_ids, **columns) -> list[float]:
    """A value of the tokens themselves: varies between any two different completions."""
    return [float(sum(ids) % 4) for ids in completion_ids]
