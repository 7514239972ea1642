"""Precision recipes on a real GPU with Transformer Engine (marker `gpu`: skipped without CUDA).

Two levels:
- TE itself: each recipe this device supports builds, a TE Linear runs under `precision.autocast`,
  and `adapter_autocast_off` really leaves FP8 inside it.
- Whole runs through the public entry point (`python -m ftcore.train`), reading
  `<run.dir>/metrics.jsonl`, so these tests do not depend on trainer internals.

Stated tolerances (same seed, data order and initial weights; mean loss of the last 5 of 30 steps):
- FP8 recipes (delayed, current, blockwise, MXFP8) vs BF16: within 5 % relative;
- NVFP4 vs BF16: within 10 % relative (E2M1 has one mantissa bit);
- BF16 with TE layers vs megatron's local layers (full and LoRA): every step within 2 % relative
  (the same math, different fused kernels).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftcore import precision
from ftcore.config import compose, conf_dir

pytestmark = pytest.mark.gpu

QUANTIZED = ["fp8_delayed", "fp8_cs", "fp8_blockwise", "mxfp8", "nvfp4"]
TOLERANCE = {
    "fp8_delayed": 0.05,
    "fp8_cs": 0.05,
    "fp8_blockwise": 0.05,
    "mxfp8": 0.05,
    "nvfp4": 0.10,
}
STEPS = 30
RUN = [
    "cluster.device=cuda",
    f"train.max_steps={STEPS}",
    "eval.interval=0",
    "checkpoint.interval=0",
    "checkpoint.save_at_end=false",
    "logger.progress=lines",
]


def gpu_cfg(name: str, exp: str = "tiny_full", *more: str):
    return compose([f"+exp={exp}", f"precision={name}", "cluster.device=cuda", *more])


def skip_unless_runs(name: str) -> None:
    """Skip a recipe this GPU / TE / CUDA cannot run (the hardware check's own verdict)."""
    from ftcore.errors import FtcoreError

    try:
        precision.check_hardware(gpu_cfg(name))
    except FtcoreError as e:
        pytest.skip(f"{name} does not run here: {e}")


def train(run_dir: Path, *overrides: str, exp: str = "tiny_full") -> list[float]:
    """One run through the entry point; the per-step losses from metrics.jsonl."""
    cmd = [
        sys.executable,
        "-m",
        "ftcore.train",
        f"+exp={exp}",
        *RUN,
        *overrides,
        f"run.dir={run_dir}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    losses = [r["loss"] for r in lines if "loss" in r]
    assert len(losses) == STEPS
    return losses


def tail(losses: list[float], n: int = 5) -> float:
    return sum(losses[-n:]) / n


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs cached by their overrides, so the BF16 reference is trained once."""
    cache: dict[tuple, list[float]] = {}

    def get(*overrides: str, exp: str = "tiny_full") -> list[float]:
        key = (exp, *overrides)
        if key not in cache:
            d = tmp_path_factory.mktemp("run")
            cache[key] = train(d / "run", *overrides, exp=exp)
        return cache[key]

    return get


# ---------------------------------------------------------------- Transformer Engine level


@pytest.mark.parametrize("name", QUANTIZED)
def test_recipe_builds_and_autocast_toggles(name):
    skip_unless_runs(name)
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipes
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    cfg = gpu_cfg(name)
    recipe = precision.te_recipe(cfg)
    cls_name, kwargs = precision.te_recipe_spec(cfg)
    assert type(recipe).__name__ == cls_name
    for key, value in kwargs.items():
        expected = getattr(te_recipes.Format, value) if key == "fp8_format" else value
        assert getattr(recipe, key) == expected, key

    lin = te.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with precision.autocast(cfg):
        assert FP8GlobalStateManager.is_fp8_enabled()
        y = lin(x)
        with precision.adapter_autocast_off():
            assert not FP8GlobalStateManager.is_fp8_enabled()
            y_hp = lin(x)  # the same module, now in BF16
        assert FP8GlobalStateManager.is_fp8_enabled()
    y.float().square().mean().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    # quantised and BF16 outputs agree to the format's precision, and differ (FP8 really ran)
    rel = ((y.float() - y_hp.float()).norm() / y_hp.float().norm()).item()
    assert 0 < rel < (0.25 if name == "nvfp4" else 0.1)


def test_layer_spec_is_transformer_engine():
    cfg = gpu_cfg("bf16")
    if not precision.use_te(cfg):
        pytest.skip("Transformer Engine is not installed")
    spec = precision.layer_spec(cfg)
    names = str(spec)
    assert "TELayerNormColumnParallelLinear" in names and "TERowParallelLinear" in names
    assert precision.layer_spec(gpu_cfg("bf16", "tiny_full", "precision.te_layers=false")) is None


def test_adapter_input_is_dequantised():
    skip_unless_runs("fp8_cs")
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    q = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=x.device)(x)
    out = precision.high_precision(q)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out.float(), x.float(), rtol=0.07, atol=1e-2)


# ---------------------------------------------------------------- whole runs


def test_bf16_te_layers_match_local_layers(runs):
    """The TE spec is the same model as megatron's local spec: BF16 loss curves agree."""
    if not precision.use_te(gpu_cfg("bf16")):
        pytest.skip("Transformer Engine is not installed")
    te_run = runs("precision=bf16")
    local = runs("precision=bf16", "precision.te_layers=false")
    for a, b in zip(te_run, local):
        assert abs(a - b) <= 0.02 * abs(b), (te_run, local)


@pytest.mark.parametrize("name", QUANTIZED)
def test_recipe_trains_and_tracks_bf16(runs, name):
    skip_unless_runs(name)
    losses = runs(f"precision={name}")
    assert all(math.isfinite(v) for v in losses), losses
    assert tail(losses) < sum(losses[:5]) / 5 - 0.1, losses  # it learns
    ref = runs("precision=bf16")
    assert abs(tail(losses) - tail(ref)) <= TOLERANCE[name] * tail(ref), (losses, ref)


def _lora_run() -> tuple[str, list[str]]:
    """exp/tiny_lora when present, else the tiny full run with LoRA adapters."""
    if (conf_dir() / "exp" / "tiny_lora.yaml").exists():
        return "tiny_lora", []
    return "tiny_full", ["peft=lora"]


def test_te_lora_matches_local_lora_in_bf16(runs):
    """TE LoRA layers (ftcore.peft.te_layers) vs the non-TE LoRA layers, both BF16."""
    exp, extra = _lora_run()
    if not precision.use_te(gpu_cfg("bf16", exp, *extra)):
        pytest.skip("Transformer Engine is not installed")
    te_run = runs("precision=bf16", *extra, exp=exp)
    local = runs("precision=bf16", "precision.te_layers=false", *extra, exp=exp)
    for a, b in zip(te_run, local):
        assert abs(a - b) <= 0.02 * abs(b), (te_run, local)


@pytest.mark.parametrize("name", ["fp8_cs", "nvfp4"])
def test_lora_on_a_quantised_base(runs, name):
    """Base GEMMs in the recipe, adapters in BF16: trains, and stays near the BF16 LoRA run."""
    skip_unless_runs(name)
    exp, extra = _lora_run()
    losses = runs(f"precision={name}", *extra, exp=exp)
    ref = runs("precision=bf16", *extra, exp=exp)
    assert all(math.isfinite(v) for v in losses)
    assert tail(losses) < sum(losses[:5]) / 5, losses
    assert abs(tail(losses) - tail(ref)) <= TOLERANCE[name] * tail(ref), (losses, ref)
