"""Qwen3-MoE and Mixtral against transformers' own models (docs/moe.md)."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_helpers import (
    check_against_hf,
    hf_model,
    hf_text_loss,
    load_case,
    tokens,
    write_text_data,
)
from tests.support.moe import make_tiny_moe

RTOL = 1e-5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("moe"), {}

    def get(family: str) -> dict:
        if family not in cache:
            path = make_tiny_moe(root / family, family, seed=11)
            data = write_text_data(root / f"{family}.jsonl", n=7, seed=4)
            x = tokens(seed=6)
            with torch.no_grad():
                logits = hf_model(path)(input_ids=x).logits.float()
            cache[family] = {"path": str(path), "data": str(data), "x": x, "logits": logits,
                             "loss": hf_text_loss(path, data)}  # fmt: skip
        return cache[family]

    return get


@pytest.mark.dist
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_ep1_eval(family, pool1, built, tmp_path):
    ref = built(family)
    res = pool1.run(load_case, ref["path"], str(tmp_path), [], ref["x"], ref["data"])
    check_against_hf(res, ref, f"{family} ep1", RTOL)
