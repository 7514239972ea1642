"""Nucleus (top-p) sampling: the filter on known logits, its refusal out of range, and its place
in `_choose` (temperature, top-k, then top-p, as transformers orders them)."""

from __future__ import annotations

import math

import pytest
import torch

from ftcore.inference.generation import _choose, nucleus
from tests.unit.validation.test_preflight import cli


def test_nucleus_keeps_the_fewest_tokens_reaching_top_p():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15], [0.4, 0.1, 0.3, 0.2]])
    logits = probs.log()
    kept = nucleus(logits, 0.75).softmax(-1)
    # row 0: 0.5 < 0.75, 0.5 + 0.3 reaches it: 0.15 and 0.05 get zero probability
    assert torch.allclose(kept[0], torch.tensor([0.625, 0.0, 0.375, 0.0]))
    # row 1: 0.4 + 0.3 < 0.75, + 0.2 reaches it
    assert torch.allclose(kept[1], torch.tensor([4 / 9, 0.0, 3 / 9, 2 / 9]))
    wider = nucleus(logits, 0.81).softmax(-1)[0] > 0  # 0.8 < 0.81: the 0.15 token joins
    assert wider.tolist() == [True, False, True, True]
    assert torch.equal(nucleus(logits, 1.0), logits)  # off: every token stays
    tiny = nucleus(logits, 1e-6).softmax(-1)  # the most likely token always stays
    assert tiny[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_sampling_stays_in_the_nucleus_and_repeats_with_the_seed():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(0))
    allowed = nucleus(logits, 0.5) > -math.inf

    def draw(seed):
        return _choose(logits, 1.0, 0, 0.5, torch.Generator().manual_seed(seed))

    a = draw(3)
    assert allowed[torch.arange(64), a].all()
    assert torch.equal(a, draw(3)) and not torch.equal(a, draw(4))
    assert allowed.sum() < allowed.numel() // 4  # the filter removed most tokens


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.1"])
def test_top_p_out_of_range_is_refused(tmp_path, bad):
    p = cli("generate", "+exp=tiny_lora", "generate.prompt=hi", f"generate.top_p={bad}",
            f"run.dir={tmp_path}")  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert "ftcore error:" in p.stderr and "generate.top_p" in p.stderr
