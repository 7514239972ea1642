"""objective=grpo's configuration: TRL's names compose, each refusal names its field (exit 2) before
anything is built, a reward function that cannot be imported is refused at the check, and
ftcore.eval refuses objective=grpo before it launches a worker."""

from __future__ import annotations

import pytest

from ftcore.config.ranges import check_ranges
from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.validation import checks

GRPO = ["+exp=tiny_grpo"]


def _refusal(*overrides: str) -> FtcoreError:
    cfg = compose([*GRPO, *overrides])
    with pytest.raises(FtcoreError) as e:
        check_ranges(cfg)
        checks.check_choices(cfg)
        checks.check_layout(cfg, 1, training=True)
    return e.value


def test_tiny_grpo_composes_with_trls_names_and_passes():
    cfg = compose(GRPO)
    checks.check_choices(cfg)
    checks.check_layout(cfg, 1)
    o = cfg.objective
    assert (o.name, o.loss_type, o.beta, o.scale_rewards, o.num_iterations) == (
        "grpo", "dapo", 0.0, "group", 1)  # fmt: skip
    assert [r.fn for r in o.rewards] == ["last_number", "regex"]


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["objective.loss_type=cispo"], "objective.loss_type", "a TRL loss ftcore does not compute"),
        (["objective.loss_type=[grpo]"], "objective.loss_type", "grpo, dapo, dr_grpo, bnpo"),
        (["objective.scale_rewards=std"], "objective.scale_rewards", "group, batch, none"),
        (["train.global_batch_size=60"], "train.global_batch_size", "whole groups"),
        (["objective.num_generations=1"], "objective.num_generations", "[2, inf)"),
        (["objective.temperature=0"], "objective.temperature", "(0, inf)"),
        (["parallel.cp=2", "cluster.num_gpus=2"], "parallel.cp", "context parallelism"),
        (["parallel.pp=2", "parallel.vp=2", "cluster.num_gpus=2"], "parallel.vp", "interleaved"),
        (["data.packing=true"], "data.packing", "one completion each"),
        (["data.seq_len=8"], "data.seq_len", "no room for a prompt"),
        (["train.epochs=1"], "train.epochs", "train.max_steps"),
        (["eval.interval=10"], "eval.interval", "no held-out evaluation"),
        (["objective.num_iterations=2", "checkpoint.interval=3"], "checkpoint.interval",
         "a multiple of 2"),
        (["objective.label_smoothing=0.1"], "objective.label_smoothing", "DPO's"),
        (["objective.rewards=[]"], "objective.rewards", "no reward function"),
        (["objective.rewards=[{fn: regex}]"], "objective.rewards[0].pattern", "needs a pattern"),
        (["objective.rewards=[{fn: 'regex', pattern: '('}]"], "objective.rewards[0].pattern",
         "not a regular expression"),
        (["objective.rewards=[{fn: no_such_module_here:f}]"], "objective.rewards[0].fn",
         "cannot import"),
        (["objective.rewards=[{fn: 'tests.support.grpo_rewards:nope'}]"], "objective.rewards[0].fn",
         "no function"),
        (["objective.rewards=[{fn: exactly}]"], "objective.rewards[0].fn", "module:function"),
        (["objective.rewards=[{fn: last_number}, {fn: last_number}]"], "objective.rewards[1].name",
         "two rewards"),
        (["data.format=instruction"], "data.format", "not instruction records"),
        (["precision=fp8_delayed"], "precision", "one token per row"),
    ],
)  # fmt: skip
def test_refusals_name_their_field(overrides, field, words):
    e = _refusal(*overrides)
    assert e.field == field and words in str(e) and e.fix, str(e)


def test_prompt_records_go_with_grpo_only_and_dpo_needs_a_positive_beta():
    e = _refusal("objective=sft")  # tiny_grpo's data.format=prompt under another objective
    assert e.field == "data.format" and "nothing to learn" in str(e)
    e = _refusal("objective=dpo", "objective.beta=0", "data.format=preference")
    assert e.field == "objective.beta"


def test_ftcore_eval_refuses_grpo_before_it_launches():
    from ftcore import eval as ftcore_eval

    with pytest.raises(FtcoreError) as e:
        ftcore_eval.task(compose(GRPO))
    assert e.value.field == "objective" and "no objective=grpo evaluation" in str(e.value)
