"""`make gpu-check` on a machine without CUDA: exit 2 with one line, before any install step, and
nothing written (no report, no work folder, no venv)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_gpu_check_refuses_without_cuda(tmp_path):
    # a copy of the repository, so "nothing written" is checked on a tree nobody else writes to
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", ".git", "outputs", ".whl",
                                                              "build", "__pycache__", "*.egg-info"))  # fmt: skip
    (repo / ".whl").mkdir()  # a wheel folder: nothing may be installed from it
    before = sorted(p.relative_to(repo) for p in repo.rglob("*"))
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    cmd = [make, "-s", "gpu-check", f"GPU_PY={sys.executable}"]
    r = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr  # (make's own status for a failed recipe is 2 as well)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("gpu-check:")]
    assert len(lines) == 1 and "no CUDA device" in lines[0], r.stderr
    assert "Installing" not in r.stdout + r.stderr and "pip" not in r.stdout
    after = sorted(p.relative_to(repo) for p in repo.rglob("*") if "__pycache__" not in p.parts)
    assert after == [p for p in before if "__pycache__" not in p.parts]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_gpu_check_script_exit_code_is_2():
    r = subprocess.run([sys.executable, str(ROOT / "tools/gpu_check.py")], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gpu-check: no CUDA device")


def test_gpu_wheels_keeps_only_what_the_bare_image_lacks():
    """The wheel list is ftcore's closure minus torch/transformers/peft's, markers evaluated for
    the target Python (a dependency for old Pythons only is not followed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "tools" / "gpu_wheels.py")
    gw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gw)

    def item(name, *requires):
        return {"metadata": {"name": name, "version": "1", "requires_dist": list(requires)}}

    items = {i["metadata"]["name"]: i for i in [
        item("torch", "numpy", "typing-extensions"), item("transformers", "numpy", "pyyaml"),
        item("peft", "torch", "transformers"), item("numpy"), item("pyyaml"),
        item("typing-extensions"), item("antlr4-python3-runtime"),
        item("megatron-core", "torch>=2.6", "numpy", "packaging"), item("packaging"),
        item("hydra-core", "omegaconf", "importlib-resources; python_version < '3.9'"),
        item("omegaconf", "antlr4-python3-runtime==4.9.*", "pyyaml"), item("importlib-resources"),
    ]}  # fmt: skip
    bare = gw.closure(gw.BARE, items, "3.12")
    wanted = gw.closure(["megatron-core", "hydra-core"], items, "3.12") - bare
    assert wanted == {
        "megatron-core",
        "packaging",
        "hydra-core",
        "omegaconf",
        "antlr4-python3-runtime",
    }


def test_gpu_wheels_bring_every_plugin_gpu_check_uses():
    """Issue 41: the wheels left out pytest-xdist, so `make gpu-check --workers N` ran one test at a
    time on a bare image."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "tools" / "gpu_wheels.py")
    gw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gw)
    assert {"pytest", *_gpu_check().PLUGINS} <= set(gw.TEST)
    assert "pytest-xdist" in _gpu_check().PLUGINS


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    return gc


def test_throughput_is_predicted_for_the_gpu_it_ran_on():
    """The planner is asked about the GPU the run measured (an H200 run was first compared with an
    H100 prediction); a GPU ftcore has no cluster file for keeps the experiment's."""
    gc = _gpu_check()
    assert gc.cluster_of("NVIDIA H200") == ["cluster=h200"]
    assert gc.cluster_of("NVIDIA H100 80GB HBM3") == ["cluster=h100"]
    assert gc.cluster_of("NVIDIA GB200") == ["cluster=gb200"]  # not b200: checked first
    assert gc.cluster_of("NVIDIA B200") == ["cluster=b200"]
    assert gc.cluster_of("Tesla T4") == []
    for c in gc.CLUSTERS:
        assert (ROOT / "conf" / "cluster" / f"{c}.yaml").exists()


def test_a_step_past_the_budget_is_killed_and_its_log_kept(tmp_path):
    gc = _gpu_check()
    gc.WORK = tmp_path
    cmd = [sys.executable, "-u", "-c", "print('started', flush=True); import time; time.sleep(30)"]
    rc, text = gc.timed_run(cmd, 3, tmp_path / "x.log")
    assert rc == 124 and text.startswith("started") and "killed after 3 s" in text
    assert gc.profile(10, ["+exp=tiny_lora"]) == ["not run: 10 s of --budget left"]


def test_report_carries_what_the_tests_recorded(tmp_path):
    """The junit file of a real pytest run (pytest's own writer): outcomes per test, and what a
    test recorded with record_property (test_host_sync's syncs per step) into the report."""
    (tmp_path / "test_x.py").write_text(
        "import json, pytest\n"
        "def test_records(record_property):\n"
        "    record_property('host_syncs_per_step_2_micro_batches', json.dumps({'a.py:f': 1.0}))\n"
        "def test_skips():\n"
        "    pytest.skip('NOT RUN: needs 2 GPUs')\n"
    )  # fmt: skip
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                    "no:xdist", f"--junitxml={junit}", "test_x.py"], cwd=tmp_path,
                   capture_output=True, timeout=120)  # fmt: skip
    gc = _gpu_check()
    rows, facts = gc.parse_junit(junit)
    assert [(n, o) for n, o, _ in rows] == [("test_x::test_records", "passed"),
                                            ("test_x::test_skips", "NOT RUN")]  # fmt: skip
    assert facts == {"test_x::test_records":
                     {"host_syncs_per_step_2_micro_batches": '{"a.py:f": 1.0}'}}  # fmt: skip
    tput = {"overrides": "+exp=x", "rc": 1, "error": "no metrics"}
    vers = {"transformer-engine": "1.0"}
    text = gc.report("GPU", [], rows, "1 passed", tput, vers, "abc", facts)
    assert '- test_x::test_records: host_syncs_per_step_2_micro_batches = {"a.py:f": 1.0}' in text


def test_a_second_report_of_the_day_keeps_the_first(tmp_path):
    gc = _gpu_check()
    first = gc.report_path(tmp_path, "2026-11-26", "NVIDIA H200")
    assert first.name == "2026-11-26-nvidia-h200.md"
    first.write_text("run 1")
    assert (
        gc.report_path(tmp_path, "2026-11-26", "NVIDIA H200").name == "2026-11-26-nvidia-h200-2.md"
    )


def test_every_lent_gpu_runs_dpo_with_the_stored_reference_and_a_moe_step():
    """Issue 50: `make gpu-check` runs `pytest -m gpu tests/gpu`; its DPO (precompute_ref) and MoE
    cases need one GPU and no Transformer Engine, so any lent GPU (the H200s so far had no TE)
    exercises them, and their tests exist."""
    import ast

    from tests.gpu.cases import CASES

    for name in ("dpo_precompute", "moe"):
        case = CASES[name]
        assert case.gpus == 1 and not case.te and case.refused is None, name
    over = dict(o.split("=", 1) for o in CASES["dpo_precompute"].overrides() if "=" in o)
    assert over["objective"] == "dpo" and over["objective.precompute_ref"] == "true"
    assert int(dict(o.split("=", 1) for o in CASES["moe"].overrides())["model.num_experts"]) > 1
    tree = ast.parse((ROOT / "tests" / "gpu" / "test_gpu_door.py").read_text())
    used = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert {"dpo_precompute", "moe"} <= used
