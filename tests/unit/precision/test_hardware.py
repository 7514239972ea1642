"""Every config the GPU path runs passes ftcore's validation on its target GPU, checked on CPU:
each `conf/exp` file and each run of tests/gpu (tests/gpu/cases.py), with the GPU of its cluster
simulated (compute capability from conf/cluster) and the Transformer Engine and CUDA versions of
ftcore's pinned container (ftcore/precision/ngc.py). Only TE's own run-time probe is skipped: it needs the
device. A config validation refuses on CUDA (tests/gpu once ran packing with micro-batch 4) fails here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ftcore.config.schema import compose, conf_dir
from ftcore.errors import FtcoreError
from ftcore.precision import hardware, ngc
from ftcore.validation.checks import validate
from tests.gpu.cases import CASES

ROOT = Path(__file__).resolve().parents[3]
IMAGE = ngc.IMAGES[ngc.pinned_tag(ROOT / "Dockerfile")]
EXPS = sorted(p.stem for p in (conf_dir() / "exp").glob("*.yaml"))


def check_on_target(cfg, launched: int) -> int:
    device = hardware.simulated_device(cfg, te=IMAGE.te, cuda_version=IMAGE.cuda)
    return validate(cfg, launched, device=device)


@pytest.mark.parametrize("exp", EXPS)
def test_every_exp_validates_on_its_target(exp):
    # the user brings the base (model.hf_path); its files are checked apart (tests/unit/validation/test_preflight.py)
    cfg = compose([f"+exp={exp}", "model.allow_random_base=true"])
    launched = cfg.cluster.num_gpus or cfg.launcher.nproc_per_node
    check_on_target(cfg, launched)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_gpu_test_run_validates_on_its_target(name):
    case = CASES[name]
    cfg = compose(case.overrides())
    assert cfg.cluster.device == "cuda", "a GPU test must target a CUDA cluster"
    if case.refused:  # the GPU test checks the refusal happens on the GPU too
        with pytest.raises(FtcoreError) as e:
            check_on_target(cfg, case.gpus)
        assert e.value.field == case.refused, e.value
        return
    check_on_target(cfg, case.gpus)


def test_gpu_check_throughput_run_validates_on_an_h100():
    """`make gpu-check`'s 8B-shaped LoRA run (tools/gpu_check.py TPUT) is a valid 1-GPU job."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    cfg = compose(gpu_check.TPUT)
    assert cfg.cluster.name == "h100" and cfg.model.hf_path is None  # random base
    check_on_target(cfg, 1)


def test_the_check_refuses_what_cuda_refuses():
    """Not vacuous: the old tests/gpu run (packed rows, micro-batch 4) and an NVFP4 run on an
    H100, or with the TE of the old 25.06 image, are refused by the same check."""
    old = compose(["+exp=tiny_full", "cluster=h100", "cluster.num_gpus=null", "precision=bf16"])
    with pytest.raises(FtcoreError, match="micro_batch_size"):
        check_on_target(old, 1)
    nvfp4 = CASES["nvfp4"].overrides()
    with pytest.raises(FtcoreError, match="compute capability"):
        check_on_target(compose([*nvfp4, "cluster=h100"]), 1)
    cfg = compose(nvfp4)
    dev = hardware.simulated_device(cfg, te="2.4.0", cuda_version=IMAGE.cuda)
    with pytest.raises(FtcoreError, match="Transformer Engine >= 2.7"):
        validate(cfg, 1, device=dev)


def test_require_te_turns_a_missing_te_into_an_error(monkeypatch):
    monkeypatch.setenv("FTCORE_GPU_REQUIRE_TE", "1")
    cfg = compose(CASES["bf16_te"].overrides())
    assert cfg.gpu.require_te is True
    no_te = hardware.simulated_device(cfg, te=None, cuda_version=IMAGE.cuda)
    with pytest.raises(FtcoreError, match="gpu.require_te"):
        validate(cfg, 1, device=no_te)
    monkeypatch.delenv("FTCORE_GPU_REQUIRE_TE")
    assert compose(CASES["bf16_te"].overrides()).gpu.require_te is False
    validate(cfg := compose(CASES["bf16_te"].overrides()), 1, device=no_te)  # local layers
    assert not cfg.gpu.require_te


@pytest.mark.parametrize(
    "extra",
    [["data.packing=true", "train.micro_batch_size=1"],
     ["data.packing=false", "parallel.cp=2", "cluster.num_gpus=2"]],
    ids=["packed", "cp2"],
)  # fmt: skip
def test_fp32_with_te_layers_and_thd_or_cp_is_refused(extra):
    """Issue 41, item 6 (TE 2.9's backend rules, recipes.check_te_attention): fp32 leaves TE's
    attention no backend for packed rows or CP; tiny_full's defaults on a TE GPU hit it. bf16
    or megatron's local layers run; without TE (local layers) nothing is refused."""
    over = ["+exp=tiny_full", "cluster=h100", "cluster.num_gpus=1", *extra]
    with pytest.raises(FtcoreError) as e:
        check_on_target(compose(over), 1 if "parallel.cp=2" not in extra else 2)
    assert e.value.field == "precision" and "te_layers=false" in e.value.fix
    n = 2 if "parallel.cp=2" in extra else 1
    for ok in ("precision=bf16", "precision.te_layers=false"):
        check_on_target(compose([*over, ok]), n)
    no_te = hardware.simulated_device(compose(over), te=None, cuda_version=IMAGE.cuda)
    validate(compose(over), n, device=no_te)
    with pytest.raises(FtcoreError, match="attention backend"):  # the dry run's target check too
        from ftcore.validation.preflight import check_target_hardware

        check_target_hardware(compose(over))
