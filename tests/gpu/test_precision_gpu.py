"""FP8/FP4 on a real GPU through Transformer Engine (TE): the recipe is really active inside the
model (TE's FP8 state moved, the loss is not BF16's) and training tracks BF16.

Stated tolerances (same seed, data order and initial weights; mean loss of the last 5 of 30 steps):
FP8 recipes vs BF16 within 5 % relative, NVFP4 within 10 % (E2M1 has one mantissa bit); BF16 with
TE layers vs megatron's local layers every step within 2 % (the same math, other kernels).
A recipe this GPU cannot run is NOT RUN (its hardware check's reason); TE absent is NOT RUN, or a
failure with gpu.require_te."""

from __future__ import annotations

import math

import pytest
import torch

from ftcore.config.schema import compose
from ftcore.precision import recipes
from tests.gpu.cases import CASES
from tests.gpu.conftest import need_runs, need_te

pytestmark = pytest.mark.gpu

QUANTIZED = ["fp8_delayed", "fp8_cs", "fp8_blockwise", "mxfp8", "nvfp4"]
TOLERANCE = {
    "fp8_delayed": 0.05,
    "fp8_cs": 0.05,
    "fp8_blockwise": 0.05,
    "mxfp8": 0.05,
    "nvfp4": 0.10,
}


def tail(losses: list[float], n: int = 5) -> float:
    return sum(losses[-n:]) / n


@pytest.mark.parametrize("name", QUANTIZED)
def test_recipe_builds_and_autocast_toggles(name):
    """TE level: the recipe object matches the config; FP8 is on inside recipes.autocast and
    off inside adapter_autocast_off; the quantised output differs from BF16's, but not by much."""
    need_runs(name)
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipes
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    cfg = compose(CASES[name].overrides())
    recipe = recipes.te_recipe(cfg)
    cls_name, kwargs = recipes.te_recipe_spec(cfg)
    assert type(recipe).__name__ == cls_name
    for key, value in kwargs.items():
        expected = getattr(te_recipes.Format, value) if key == "fp8_format" else value
        assert getattr(recipe, key) == expected, key
    lin = te.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with recipes.autocast(cfg):
        assert FP8GlobalStateManager.is_fp8_enabled()
        y = lin(x)
        with recipes.adapter_autocast_off():
            assert not FP8GlobalStateManager.is_fp8_enabled()
            y_hp = lin(x)
    y.float().square().mean().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    rel = ((y.float() - y_hp.float()).norm() / y_hp.float().norm()).item()
    assert 0 < rel < (0.25 if name == "nvfp4" else 0.1)


@pytest.mark.parametrize("name", QUANTIZED)
def test_recipe_is_active_in_the_model_and_tracks_bf16(runs, name):
    need_runs(name)
    got, ref = runs(name), runs("bf16_te")
    fp8, losses = got["fp8"], got["losses"]
    cls_name, _ = recipes.te_recipe_spec(compose(CASES[name].overrides()))
    # the recipe ran inside the model: TE modules in FP8 with this recipe ...
    assert fp8 and fp8["fp8_modules"] > 0 and cls_name in fp8["recipes"], fp8
    if name == "fp8_delayed":  # ... and delayed scaling's amax history and scales were updated
        assert fp8["amax_nonzero"] > 0 and fp8["scale_changed"] > 0, fp8
    assert all(math.isfinite(v) for v in losses), losses
    assert max(abs(a - b) for a, b in zip(losses, ref["losses"])) > 0, "identical to BF16: FP8 off?"
    assert tail(losses) < sum(losses[:5]) / 5 - 0.1, losses  # it learns
    assert abs(tail(losses) - tail(ref["losses"])) <= TOLERANCE[name] * tail(ref["losses"])


def test_bf16_te_layers_match_local_layers(runs):
    need_te()
    te_run, local = runs("bf16_te")["losses"], runs("bf16_local")["losses"]
    assert runs("bf16_te")["fp8"]["fp8_modules"] == 0  # BF16: no module ran in FP8
    for a, b in zip(te_run, local):
        assert abs(a - b) <= 0.02 * abs(b), (te_run, local)
