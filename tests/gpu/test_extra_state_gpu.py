"""Issue 51: Transformer Engine's pickled FP8 state (a module's `_extra_state`) passes ftcore's
check (safe_files.check_extra_state) as a real TE module writes it under delayed scaling, the only
recipe that still pickles state; the CPU tests check it against a stand-in of TE's recipe module
(tests/unit/checkpoint/test_doors.py). NOT RUN without a GPU with FP8 and TE."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import need_gpus, need_te

pytestmark = pytest.mark.gpu


def test_te_delayed_scaling_state_passes_the_check():
    need_te()
    need_gpus(1)
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    from ftcore.runtime import safe_files

    available = te.is_fp8_available()
    if not (available[0] if isinstance(available, tuple) else available):
        pytest.skip(f"NOT RUN: FP8 is not available on this GPU ({available})")
    layer = te.Linear(64, 64, params_dtype=torch.bfloat16).cuda()
    with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
        layer(torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    state = layer.get_extra_state()
    assert state.dtype == torch.uint8 and state.numel() > 0
    safe_files.check_extra_state(state.cpu().numpy().tobytes(), "linear._extra_state")
