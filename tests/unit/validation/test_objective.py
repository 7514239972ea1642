"""The objective section: sft by default, dpo's TRL names, and each refusal in one line (exit 2)."""

from __future__ import annotations

import pytest

from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.validation import checks


def _refusal(*overrides: str) -> FtcoreError:
    cfg = compose(["+exp=tiny_lora", *overrides])
    with pytest.raises(FtcoreError) as e:
        checks.check_choices(cfg)
    return e.value


def test_default_is_sft_and_dpo_composes():
    assert compose(["+exp=tiny_lora"]).objective.name == "sft"
    cfg = compose(["+exp=tiny_lora", "objective=dpo", "objective.loss_type=[sigmoid,sft]",
                   "objective.loss_weights=[1.0,0.5]"])  # fmt: skip
    checks.check_choices(cfg)
    o = cfg.objective
    assert (o.name, o.beta, list(o.loss_type)) == ("dpo", 0.1, ["sigmoid", "sft"])
    assert list(o.loss_weights) == [1.0, 0.5]


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["objective.loss_type=[kto]"], "objective.loss_type", "sigmoid, hinge, ipo, robust, sft"),
        (["objective.loss_type=[aot]"], "objective.loss_type", "a TRL loss ftcore does not compute"),
        (["objective.loss_type=[sigmoid,sft]", "objective.loss_weights=[1.0]"],
         "objective.loss_weights", "1 weights for 2 losses"),
        (["objective.label_smoothing=0.1"], "objective.label_smoothing", "only robust reads it"),
        (["objective.loss_type=[ipo,hinge]", "objective.label_smoothing=0.1"],
         "objective.label_smoothing", "ignored by ipo, hinge"),
        (["peft=none", "objective.ref_adapter_path=x"], "objective.ref_adapter_path", "full fine-tuning"),
        (["objective.ref_adapter_path=/nonexistent"], "objective.ref_adapter_path", "not a PEFT"),
        (["model.family=qwen3_moe", "model.num_experts=4", "model.moe_ffn_hidden_size=64"],
         "objective", "mixture of experts"),
    ],
)  # fmt: skip
def test_refusals_name_field_and_trl(overrides, field, words):
    e = _refusal("objective=dpo", *overrides)
    assert e.field == field and words in str(e) and e.fix


def test_label_smoothing_with_robust_and_range():
    cfg = compose(["+exp=tiny_lora", "objective=dpo", "objective.loss_type=[robust]",
                   "objective.label_smoothing=0.1"])  # fmt: skip
    checks.check_choices(cfg)
    from ftcore.config.ranges import check_ranges

    cfg.objective.label_smoothing = 0.5
    with pytest.raises(FtcoreError, match="objective.label_smoothing"):
        check_ranges(cfg)
