"""Packing changes nothing but speed: the same documents in one forward/backward, packed (first-fit-
decreasing rows, position ids restarting per document, block-diagonal causal mask) and unpacked
(one document per row), give the same loss and gradients to 1e-5 at fp32 on CPU, on one process
and at TP=2, PP=2, DP=2 and PP=4 (middle pipeline stages must keep documents apart too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ftcore.data.packing import first_fit_decreasing, make_microbatch
from ftcore.data.templates import Doc
from ftcore.models.sharding import iter_params, join_shards, shard_info
from ftcore.training import trainer
from tests.support.layouts import build

RTOL = 1e-5
SEQ = 32
LENGTHS = [
    20,
    12,
    9,
    7,
    25,
    5,
    18,
    14,
    30,
    2,
    16,
    10,
]  # FFD packs these 12 documents into 6 rows of 32
PACKED_ROWS = 8  # FFD gives 6; two all-padding rows make it divide micro batch x DP


def documents(vocab: int) -> list[Doc]:
    r = np.random.default_rng(0)
    return [Doc(r.integers(0, vocab, n).astype(np.int32), r.random(n) < 0.7) for n in LENGTHS]


def rows(packed: bool) -> list[list[int]]:
    if not packed:
        return [[i] for i in range(len(LENGTHS))]
    bins = first_fit_decreasing(LENGTHS, SEQ)
    assert len(bins) <= PACKED_ROWS
    return bins + [[] for _ in range(PACKED_ROWS - len(bins))]


def full_grads(state) -> dict[str, torch.Tensor]:
    """Full (TP-joined) gradients of this PP rank's parameters; empty on non-zero TP/DP ranks."""
    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in iter_params(state.model):
        g = getattr(p, "main_grad", None)
        g = (g if g is not None else p.grad).detach().float().contiguous()
        shards = [torch.empty_like(g) for _ in range(tp)]
        dist.all_gather(shards, g, group=ps.get_tensor_model_parallel_group())
        if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            out[name] = join_shards(shards, shard_info(name, p, tp))
    return out


def forward_backward(overrides: list[str], run_dir: str, packed: bool) -> dict:
    """One forward/backward of the fixed documents; loss and this rank's share of the gradients."""
    all_rows = rows(packed)
    micro = 2
    state = build(
        [
            *overrides,
            f"data.seq_len={SEQ}",
            f"train.global_batch_size={len(all_rows)}",
            f"train.micro_batch_size={micro}",
        ],
        run_dir,
    )
    docs = documents(state.cfg.model.vocab_size)
    per = len(all_rows) // state.dp
    mine = all_rows[ps.get_data_parallel_rank() * per : (ps.get_data_parallel_rank() + 1) * per]
    pad = state.cfg.model.vocab_size - 1
    mbs = [
        make_microbatch([[docs[d] for d in r] for r in mine[i : i + micro]], SEQ, pad)
        for i in range(0, per, micro)
    ]
    for chunk in state.model:
        chunk.zero_grad_buffer()
    loss_sum, n = trainer.run_batches(state, mbs, forward_only=False)
    return {"loss": loss_sum / n, "targets": n, "grads": full_grads(state)}


def _merge(results: list[dict]) -> dict:
    grads = {}
    for r in results:
        grads.update(r["grads"])
    return {"loss": results[0]["loss"], "targets": results[0]["targets"], "grads": grads}


def _close(got: dict, ref: dict, what: str) -> None:
    assert got["targets"] == ref["targets"], what
    rel = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    assert rel <= RTOL, f"{what}: loss relative difference {rel:.2e}"
    assert got["grads"].keys() == ref["grads"].keys(), what
    for k, g in ref["grads"].items():
        rel = (
            (got["grads"][k].double() - g.double()).norm() / g.double().norm().clamp_min(1e-30)
        ).item()
        assert rel <= RTOL, f"{what} {k}: gradient relative difference {rel:.2e} > {RTOL}"


@pytest.fixture(scope="module")
def reference(pool1, tmp_path_factory):
    """Unpacked, one process."""
    return pool1.run(forward_backward, [], str(tmp_path_factory.mktemp("ref")), False)[0]


@pytest.mark.dist
def test_packed_equals_unpacked_single_process(pool1, reference, tmp_path):
    got = pool1.run(forward_backward, [], str(tmp_path), True)[0]
    _close(got, reference, "packed, 1 process")


LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "dp2": []}


@pytest.mark.dist
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_packed_and_unpacked_match_across_layouts(pool2, reference, tmp_path, name, packed):
    got = _merge(pool2.run(forward_backward, LAYOUTS[name], str(tmp_path), packed))
    _close(got, reference, f"{name} {'packed' if packed else 'unpacked'}")


@pytest.mark.dist
def test_packed_pp4_middle_stages(pool4, reference, tmp_path):
    got = _merge(pool4.run(forward_backward, ["parallel.pp=4"], str(tmp_path), True))
    _close(got, reference, "pp4 packed")
