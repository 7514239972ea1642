"""Context parallelism does not change the math: each CP rank holds chunks r and 2*cp-1-r of every
row (data/cp.py) and the CPU attention all-gathers K/V (models/local/cp_attention.py). fp32 on CPU,
5 optimizer steps, unpacked and packed rows (the same rows at every cp; at cp=2 documents
padded to 4 and split per document as TE's THD layout does, at cp=1 nothing padded): cp=2 (with the distributed optimizer sharded over
dp x cp), cp=2 x tp=2 and cp=2 x pp=2 give cp=1's losses, gradient norms, weights and eval loss to
1e-5 relative. One pool run per layout serves every assertion about it."""

from __future__ import annotations

import pytest
import torch

from tests.support.cp_cases import attention_against_whole, train_unpacked_and_packed
from tests.support.layouts import merge_weights

RTOL = 1e-5
STEPS = 5
SEQ = 32  # tests/support/tiny.py


@pytest.mark.dist
def test_cp_attention_matches_whole_sequence(pool2):
    for r in pool2.run(attention_against_whole):
        assert r["same_batch"] and r["same_rope"], r  # megatron's load-balanced chunks
        assert r["same_document_split"], r
        assert r["shape"] == (16, 2, 32)  # half of the 32 positions on each rank
        for k in ("out", "dq", "dk", "dv", "packed_out", "packed_q", "packed_k", "packed_v"):
            assert r[k] <= 1e-10, (k, r)


@pytest.fixture(scope="module")
def reference(pool1, tmp_path_factory):
    return pool1.run(train_unpacked_and_packed, [], str(tmp_path_factory.mktemp("cp1")), STEPS)[0]


def _close(a, b, what):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    rel = ((a - b).abs() / b.abs().clamp_min(1e-12)).max().item()
    assert rel <= RTOL, f"{what}: max relative difference {rel:.2e} > {RTOL}"


def _check(results: list[dict], reference: dict, name: str) -> None:
    for mode, ref in reference.items():
        ranks = [r[mode] for r in results]
        got = next(r for r in ranks if r["loss"])  # a last-stage rank (others log no loss)
        what = f"{name} {mode}"
        assert ref["seen"] == [SEQ]
        assert all(r["seen"] == [SEQ // 2] for r in ranks), (what, [r["seen"] for r in ranks])
        last = [r for r in ranks if r["targets"]]  # logits at this rank's own targets only
        assert last and all(r["output_rows"] == r["targets"] for r in last), what
        # every rank reports the step's tokens over the world, each counted once
        assert all(r["tokens"] == ref["tokens"] for r in ranks), (
            what,
            [r["tokens"] for r in ranks],
        )
        _close(got["loss"], ref["loss"], f"{what} losses")
        _close(got["grad_norm"], ref["grad_norm"], f"{what} grad norms")
        _close(got["eval"][0], ref["eval"][0], f"{what} eval loss")
        assert got["eval"][1] == ref["eval"][1], what
        weights = merge_weights(ranks)
        assert weights.keys() == ref["weights"].keys(), what
        for k, w in ref["weights"].items():
            rel = ((weights[k].double() - w.double()).norm() / w.double().norm()).item()
            assert rel <= RTOL, f"{what} {k}: relative difference {rel:.2e}"


@pytest.mark.dist
def test_cp2_with_distributed_optimizer(pool2, reference, tmp_path):
    cp2 = ["parallel.cp=2", "parallel.distributed_optimizer=true"]
    _check(pool2.run(train_unpacked_and_packed, cp2, str(tmp_path), STEPS), reference, "cp2")


@pytest.mark.dist
@pytest.mark.parametrize("other", ["parallel.tp=2", "parallel.pp=2"], ids=["tp2", "pp2"])
def test_cp2_with_tp2_or_pp2(pool4, reference, tmp_path, other):
    results = pool4.run(train_unpacked_and_packed, ["parallel.cp=2", other], str(tmp_path), STEPS)
    _check(results, reference, f"cp2 x {other}")
