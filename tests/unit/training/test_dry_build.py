"""The dry build (plan.dry_build=true, ftcore/training/dry_build.py): every conf/exp file built on
the meta device, one rank per distinct pipeline stage of its full world, counted against the
planner and checked for tensors left off the device. One process builds them all (the module fixture); the CLI's exit 2
runs once in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftcore import planner
from ftcore.config.schema import compose, conf_dir
from ftcore.errors import FtcoreError
from ftcore.training import dry_build

EXPS = sorted(p.stem for p in Path(conf_dir(), "exp").glob("*.yaml"))
NO_DIST_OPT = "parallel.distributed_optimizer=false"
QLORA = ("peft=qlora", "precision=bf16")  # NF4 base weights (bitsandbytes works on meta)
CASES = [(e,) for e in EXPS] + [("8b_lora", NO_DIST_OPT), ("tiny_lora", NO_DIST_OPT)]
CASES += [("tiny_lora", *QLORA), ("tiny_lora", *QLORA, "parallel.tp=2", "cluster.num_gpus=4")]
CASES += [("tiny_lora", "parallel.cp=2", "parallel.pp=2", "cluster.num_gpus=8")]  # CP without TE
IDS = [" ".join(c) for c in CASES]


@pytest.fixture(scope="module")
def built():
    """case -> (cfg, dry build entries), each case built once, in this process (a subset selected
    with -k builds only its own)."""
    cache: dict[tuple, tuple] = {}

    def get(case: tuple) -> tuple:
        if case not in cache:
            cfg = compose([f"+exp={case[0]}", *case[1:]])
            cache[case] = cfg, dry_build.dry_build(cfg, planner.world_of(cfg))
        return cache[case]

    return get


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_distinct_stage_is_built_with_the_planners_count(built, case):
    cfg, entries = built(case)
    pp = cfg.parallel.pp
    assert [e["pp_rank"] for e in entries] == sorted({0, pp - 1} | ({1} if pp > 2 else set()))
    for e in entries:
        assert e["params"] > 0
        assert e["params"] == e["planned_params"] == dry_build.planned_params(cfg, e["pp_rank"])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_nothing_is_off_the_device(built, case):
    _, entries = built(case)
    assert [e["off_device"] for e in entries] == [[] for _ in entries]


def test_megatron_parallel_state_over_a_fake_world_of_1024_ranks():
    from megatron.core import parallel_state as ps

    cfg = compose(["+exp=405b_full", "cluster.num_gpus=1024"])
    with dry_build.fake_world(cfg, 1024, pp_rank=15):
        assert ps.get_data_parallel_world_size() == 1024 // (8 * 16)
        assert ps.get_pipeline_model_parallel_rank() == 15
        assert torch.distributed.get_rank() == 15 * 64
    assert not torch.distributed.is_initialized()


def test_off_device_names_params_buffers_and_plain_tensors_and_check_refuses():
    class State:  # like bitsandbytes' QuantState: tensors inside a plain object
        def __init__(self):
            self.absmax = torch.zeros(2)

    m = torch.nn.Linear(2, 2, device="meta")
    m.lora = torch.nn.Parameter(torch.zeros(2))
    m.register_buffer("buf", torch.zeros(2))
    m.freq = torch.zeros(2)
    m.state = State()
    m.ok = torch.zeros(2, device="meta")
    names = dry_build.off_device([m])
    assert names == ["lora", "buf", "freq", "state.absmax"]
    good = {"pp_rank": 0, "params": 6, "planned_params": 6, "off_device": []}
    dry_build.check([good])
    with pytest.raises(FtcoreError, match="pp stage 1: 4 not on the device: lora, buf"):
        dry_build.check([good, {**good, "pp_rank": 1, "off_device": names}])
    with pytest.raises(FtcoreError, match="pp stage 0: built 6 elements, the planner counts 7"):
        dry_build.check([{**good, "planned_params": 7}])


# The CLI with one tensor born on the CPU (a buffer registered without a device), as finding 2's
# adapters are: independent of whether finding 2 is fixed. On a GPU cluster (cluster=h100) the plan
# does not probe this host's speed.
STRAY = """
import sys, torch
from ftcore.models import builder
real = builder.build_model
def build_model(cfg, **kw):
    chunks = real(cfg, **kw)
    chunks[0].register_buffer("stray", torch.zeros(1))
    return chunks
builder.build_model = build_model
from ftcore.cli import main
from ftcore.plan import task
sys.exit(main("plan", task, sys.argv[1:]))
"""


def test_cli_prints_the_plan_then_exits_2_naming_what_is_off_the_device():
    r = subprocess.run(
        [sys.executable, "-c", STRAY, "+exp=tiny_full", "cluster=h100", "plan.dry_build=true",
         "plan.format=json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    out = json.loads(r.stdout)  # the plan is still one JSON object, with dry_build beside layout
    assert "layout" in out
    (entry,) = out["dry_build"]
    assert entry["off_device"] == ["stray"] and entry["params"] == entry["planned_params"] > 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("ftcore error")]
    assert len(errors) == 1 and "plan.dry_build" in errors[0] and "stray" in errors[0]
    assert "Traceback" not in r.stderr


def test_table_shows_each_stage():
    from ftcore.planner.report import table

    cfg = compose(
        ["+exp=tiny_full", "cluster=h100"]
    )  # a GPU cluster: no probe of this host's speed
    p = planner.plan(cfg)
    p["dry_build"] = [{"pp_rank": 0, "params": 5, "planned_params": 5, "off_device": ["a.b"]}]
    lines = table(p).splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("dry build"))
    assert "pp stage 0" in lines[i + 1] and "5 planned" in lines[i + 1] and "a.b" in lines[i + 1]


def test_meta_device_sends_cuda_to_meta_and_leaves_deviceless_tensors_on_the_cpu():
    from ftcore.runtime import cpu

    with cpu.meta_device(), cpu.device_mode():
        assert not cpu.is_active()  # ftcore builds as on a GPU
        assert torch.empty(3, device="cuda").is_meta
        assert torch.empty(3, device=torch.cuda.current_device()).is_meta
        assert torch.zeros(3).cuda().is_meta and torch.zeros(3).to("cuda").is_meta
        assert torch.zeros(3).device.type == "cpu"  # what the dry build reports
        assert torch.empty(3, device="cuda").type() == "torch.cuda.FloatTensor"
        assert torch.zeros(3).type() == "torch.FloatTensor"
    with cpu.device_mode():  # the CPU runtime as before
        assert cpu.is_active()
        assert torch.empty(3, device="cuda").device.type == "cpu"
        assert torch.zeros(3).type() == "torch.cuda.FloatTensor"
