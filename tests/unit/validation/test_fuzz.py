"""Seeded config fuzzing: random override sets over every section (out of range, wrong type,
contradictory combinations) each end with exit 0 or exit 2 and one `ftcore error:` line, never a
traceback (exit 1).

Most cases run in this process through ftcore.cli.main with what each entry point runs before
anything is built: ftcore.train's launch check (checks.check_for_launch) and ftcore.plan's whole
task (on a GPU cluster: `local_cpu` would probe this host's matmul rate, planner/host.py). A
handful run the real `python -m ftcore.plan` / `ftcore.train` (train only on cases that fail
validation, so nothing trains).
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest

from ftcore import cli, plan
from ftcore.config.ranges import RANGES
from ftcore.config.schema import assets_dir
from ftcore.validation import checks
from ftcore.validation.checks import CHOICES

SEED = int(os.environ.get("FTCORE_FUZZ_SEED", "28"))
CASES = int(os.environ.get("FTCORE_FUZZ_CASES", "60"))
BASES = [
    ["+exp=tiny_lora"],
    ["+exp=tiny_full"],
    ["+exp=tiny_lora", f"model.hf_path={assets_dir() / 'tiny_base'}"],
    ["+exp=8b_lora"],
    ["+exp=70b_lora"],
    [],
]
WRONG_TYPES = ["abc", "''", "[1,2]", "{a: 1}", "null", "true", "1.5", "1e400", "-inf", "nan"]
# contradictory or unusual combinations that each entry must refuse or accept cleanly
COMBOS = [
    ["parallel.sp=true", "parallel.tp=1"],
    ["parallel.tp=3"],
    ["parallel.pp=7", "parallel.vp=3"],
    ["parallel.cp=3", "data.seq_len=100"],
    ["data.path=/nonexistent/x.jsonl", "+data.mix=[{path: /nonexistent/y.jsonl}]"],
    ["eval.accuracy=true", "data.format=text"],
    ["eval.accuracy=true", "data.path=/nonexistent/x.jsonl", "data.val_fraction=0"],
    ["data.packing=true", "cluster.device=cuda", "train.micro_batch_size=2"],
    ["peft.name=qlora", "precision=fp8_cs"],
    ["peft.name=lora", "peft.target_modules=[nothing]"],
    ["cluster.num_gpus=3"],
    ["train.global_batch_size=7", "train.micro_batch_size=2"],
    ["sched.warmup_steps=1000", "train.max_steps=3"],
    ["sched.min_lr=1.0", "optim.lr=0.001"],
    ["model.num_query_groups=3"],
    ["model.num_attention_heads=7"],
    ["model.kv_channels=1", "model.hidden_size=3"],
    ["launcher.nproc_per_node=3", "parallel.tp=2"],
    ["checkpoint.resume=/nonexistent/ckpt"],
    ["precision=nvfp4", "cluster=h100"],
    ["model.max_position_embeddings=8", "data.seq_len=4096"],
]
SKIP = {"plan.top"}  # plan.search is off in the fuzz (a search is slow); top only matters there


def _value(rng: random.Random, key: str) -> str:
    """An in-range, boundary, out-of-range or wrongly typed value for a RANGES key."""
    r = RANGES[key]
    pool = [0, 1, -1, 2, 0.5, 10 ** rng.randint(1, 12), -(10 ** rng.randint(1, 6))]
    pool += [b for b in (r.lo, r.hi) if math.isfinite(b)]
    pool += [b + d for b in (r.lo, r.hi) if math.isfinite(b) for d in (-1, 1, -1e-9, 1e-9)]
    if rng.random() < 0.2:
        return rng.choice(WRONG_TYPES)
    return repr(rng.choice(pool))


def _override(rng: random.Random) -> list[str]:
    key = rng.choice(sorted(set(RANGES) - SKIP) + sorted(CHOICES))
    if key in CHOICES:
        allowed = CHOICES[key] or ("auto", "never")
        return [f"{key}={rng.choice([*allowed, 'bogus', '42'])}"]
    if key.endswith("[].weight"):
        return [
            f"+data.mix=[{{path: {assets_dir() / 'data' / 'train.jsonl'}, weight: {_value(rng, key)}}}]"
        ]
    if key == "optim.betas.*":
        return [f"optim.betas=[{_value(rng, key)},{_value(rng, key)}]"]
    if key == "cluster.peak_tflops.*":
        return [f"cluster.peak_tflops.bf16={_value(rng, key)}"]
    if key.startswith("model.rope_scaling.") and rng.random() < 0.5:  # a section that is null
        return [f"+model.rope_scaling={{{key.rsplit('.', 1)[1]}: {_value(rng, key)}}}"]
    if key.startswith("model.rope_scaling.") and rng.random() < 0.5:
        return ["model=llama31_405b", f"{key}={_value(rng, key)}"]
    return [f"{key}={_value(rng, key)}"]


def cases(seed: int, n: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ov = list(rng.choice(BASES))
        for _ in range(rng.randint(1, 4)):
            ov += _override(rng)
        if rng.random() < 0.3:
            ov += rng.choice(COMBOS)
        out.append(ov)
    return out


def _train_checks(cfg):
    """What ftcore.train does before anything is built (dist.launch_standalone's check)."""
    checks.check_for_launch(cfg, cfg.launcher.nproc_per_node)


def _plan_overrides(ov: list[str]) -> list[str]:
    """The case on a GPU cluster, without the host probe or a (slow) search."""
    return [
        *ov,
        "cluster=h100",
        "cluster.host_probe=false",
        "plan.search=false",
        "plan.dry_build=false",
    ]


def _check(status: int, err: str, ov: list[str]) -> None:
    tail = "\n".join(err.strip().splitlines()[-4:])
    assert status in (0, 2), f"exit {status} for {ov}:\n{tail}"
    assert "Traceback" not in err, f"traceback for {ov}:\n{tail}"
    lines = [ln for ln in err.splitlines() if ln.startswith("ftcore error:")]
    assert len(lines) == (1 if status == 2 else 0), f"{ov}: {lines}"


def test_fuzz_in_process(capsys):
    failures = []
    for i, ov in enumerate(cases(SEED, CASES)):
        entry, task, args = (
            ("plan", plan.task, _plan_overrides(ov)) if i % 3 == 2 else ("train", _train_checks, ov)
        )
        status = cli.main(entry, task, args)
        out = capsys.readouterr()
        try:
            _check(status, out.err, [entry, *args])
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} of {CASES} cases failed:\n" + "\n\n".join(failures)


def _run(module: str, args: list[str]):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "FTCORE_LOG_LEVEL": "WARNING"})  # fmt: skip


@pytest.mark.parametrize(
    "module, args",
    [
        ("ftcore.train", ["+exp=tiny_full", "model.hidden_size=0"]),  # was a ZeroDivisionError
        ("ftcore.train", ["+exp=tiny_lora", "sched.min_lr=1"]),  # was megatron's AssertionError
        ("ftcore.train", ["+exp=tiny_full", "optim.lr=nan", "parallel.tp=3"]),
        ("ftcore.plan", _plan_overrides(["+exp=70b_lora", "model.ffn_hidden_size=-8"])),
        ("ftcore.plan", _plan_overrides(["+exp=8b_lora", "plan.target_fraction=0.25"])),
    ],
)
def test_fuzz_subprocess(module, args):
    r = _run(module, args)
    _check(r.returncode, r.stderr, [module, *args])
