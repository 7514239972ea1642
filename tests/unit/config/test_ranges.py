"""Every numeric config field has a range (ftcore/config/ranges.py), checked before anything is built:
out of range, NaN or inf is one `ftcore error:` line and exit 2, never a traceback."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from ftcore import cli
from ftcore.config.groups import FtcoreConfig
from ftcore.config.ranges import RANGES, check_ranges
from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.validation import checks


def _numeric_fields(cls, prefix: str = "") -> set[str]:
    """Every int/float field of the schema, in RANGES' notation (`.*` for list/dict values,
    `[]` for a list of sections); bools, strings and free-form fields (Any) are not numbers."""
    out = set()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        t = typing.get_type_hints(cls)[f.name]
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) is typing.Union and len(args) == 1:
            t = args[0]  # Optional[X]
        origin, args = typing.get_origin(t), typing.get_args(t)
        if t in (int, float):
            out.add(key)
        elif dataclasses.is_dataclass(t):
            out |= _numeric_fields(t, key + ".")
        elif origin is list and args and dataclasses.is_dataclass(args[0]):
            out |= _numeric_fields(args[0], key + "[].")
        elif origin in (list, dict) and args and args[-1] in (int, float):
            out.add(key + ".*")
    return out


def test_every_numeric_field_has_a_range():
    fields = _numeric_fields(FtcoreConfig)
    assert fields - set(RANGES) == set(), "add these fields to ftcore/config/ranges.py RANGES"
    assert set(RANGES) - fields == set(), "RANGES names fields the schema does not have"


def test_every_preset_is_in_range():
    from ftcore.config.schema import conf_dir

    for exp in sorted(p.stem for p in (conf_dir() / "exp").glob("*.yaml")):
        check_ranges(compose([f"+exp={exp}"]))


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.micro_batch_size=0", "train.micro_batch_size"),
        ("train.max_steps=-3", "train.max_steps"),
        ("optim.lr=nan", "optim.lr"),
        ("optim.lr=-1e-4", "optim.lr"),
        ("optim.betas=[0.9,1.0]", "optim.betas.1"),
        ("data.val_fraction=1.0", "data.val_fraction"),
        ("model.hidden_size=0", "model.hidden_size"),
        ("peft.lora_dropout=1.5", "peft.lora_dropout"),
        ("cluster.matmul_efficiency=0", "cluster.matmul_efficiency"),
        ("cluster.peak_tflops.bf16=inf", "cluster.peak_tflops.bf16"),
        ("+data.mix=[{path: x.jsonl, weight: 0}]", "data.mix[0].weight"),
        ("eval.iters=0", "eval.iters"),
    ],
)
def test_out_of_range_names_the_field(override, field):
    with pytest.raises(FtcoreError, match=rf"^{re.escape(field)}: .* is not in"):
        checks.validate(compose(["+exp=tiny_lora", override]), 1)


@pytest.mark.parametrize(
    "override",
    ["checkpoint.interval=0", "checkpoint.keep=0", "eval.interval=0", "train.grad_clip=0"],
)
def test_zero_keeps_its_meaning(override):
    checks.validate(compose(["+exp=tiny_lora", override]), 1)


def test_warmup_longer_than_the_run_is_clamped(caplog):
    import torch

    from ftcore.training.optim import build_scheduler

    cfg = compose(["+exp=tiny_lora", "train.max_steps=4", "sched.warmup_steps=10"])
    checks.validate(cfg, 1)  # not refused
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    with caplog.at_level("WARNING", logger="ftcore"):
        sched = build_scheduler(cfg, opt)
    assert sched.lr_warmup_steps == 4
    assert "the warm-up is scaled to the run" in caplog.text
    sched.step(4)
    assert opt.param_groups[0]["lr"] == pytest.approx(cfg.optim.lr)  # the peak is reached


def test_cli_out_of_range_is_one_line(capsys):
    status = cli.main("train", lambda cfg: checks.check_for_launch(cfg, 1) and None,
                      ["+exp=tiny_lora", "model.init_std=-1"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2 and err.count("ftcore error:") == 1 and "model.init_std" in err


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["sched.min_lr=0.1", "optim.lr=0.01"], "sched.min_lr"),  # megatron asserts at build
        (["model=llama31_405b", "model.rope_scaling.low_freq_factor=4"], "model.rope_scaling.low"),
        (["model.hidden_size=100"], "model.hidden_size"),  # 8 heads; head dim unset
    ],
)
def test_contradictory_fields_are_refused(overrides, field):
    with pytest.raises(FtcoreError, match=rf"^{re.escape(field)}"):
        checks.validate(compose(["+exp=tiny_full", *overrides]), 1)
