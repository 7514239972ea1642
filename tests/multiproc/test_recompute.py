"""Activation recompute changes memory, never the math."""

from __future__ import annotations

import pytest

from tests.support.layouts import recompute_case


@pytest.mark.dist
def test_recompute_same_losses_fewer_saved_bytes(pool1, tmp_path):
    runs = {
        mode: pool1.run(recompute_case, [f"parallel.recompute={mode}"], str(tmp_path / mode))[0]
        for mode in ("none", "selective", "full")
    }
    base = runs["none"]
    for mode in ("selective", "full"):
        for a, b in zip(runs[mode]["loss"], base["loss"]):
            assert abs(a - b) <= 1e-6 * abs(b), (mode, a, b)
    assert runs["selective"]["saved_bytes"] < base["saved_bytes"]
    assert runs["full"]["saved_bytes"] < runs["selective"]["saved_bytes"]
