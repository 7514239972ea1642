"""Activation recompute changes memory, never the math: each granularity and module choice of
parallel.recompute / recompute_modules / recompute_num_layers (docs/gpu_speed.md)."""

from __future__ import annotations

import pytest

from tests.support.layouts import recompute_case

MODES = {
    "none": ["parallel.recompute=none"],
    "selective": ["parallel.recompute=selective"],  # core attention, the default module
    "selective_mlp": ["parallel.recompute=selective", "parallel.recompute_modules=[core_attn,mlp]"],
    "full": ["parallel.recompute=full"],
    "full_2": ["parallel.recompute=full", "parallel.recompute_num_layers=2"],
}


@pytest.mark.dist
def test_recompute_same_losses_fewer_saved_bytes(pool1, tmp_path):
    runs = {
        mode: pool1.run(recompute_case, overrides, str(tmp_path / mode))[0]
        for mode, overrides in MODES.items()
    }
    base = runs["none"]
    for mode in MODES:
        for a, b in zip(runs[mode]["loss"], base["loss"]):
            assert abs(a - b) <= 1e-6 * abs(b), (mode, a, b)
    assert runs["selective"]["saved_bytes"] < base["saved_bytes"]
    assert runs["selective_mlp"]["saved_bytes"] < runs["selective"]["saved_bytes"]
    assert runs["full"]["saved_bytes"] < runs["selective_mlp"]["saved_bytes"]
    assert runs["full_2"]["saved_bytes"] < runs["selective"]["saved_bytes"]
