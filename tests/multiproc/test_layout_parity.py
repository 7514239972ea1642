"""Core promise: a layout change does not change the math. fp32 on CPU, 5 optimizer steps, 1e-5
relative. TP (with and without SP), PP, PP x VP, DP, CP, EP, the distributed optimizer and its
overlaps, crossed with each other and with every feature, are the parity matrix's
(tests/multiproc/test_parity_matrix.py, docs/parallelism.md); here what it does not reach:
micro-batching against one micro-batch, an uneven pipeline split, the output layer's rows."""

from __future__ import annotations

import pytest
import torch

from tests.support.layouts import merge_weights, train_and_collect

RTOL = 1e-5
STEPS = 5


@pytest.fixture(scope="module")
def reference(pool1, tmp_path_factory):
    """TP=1/PP=1/DP=1 with the whole global batch as one micro-batch."""
    return pool1.run(
        train_and_collect, ["train.micro_batch_size=8"], str(tmp_path_factory.mktemp("ref")), STEPS
    )[0]


def _close_weights(got: dict, ref: dict, what: str) -> None:
    """Every tensor within 1e-5 relative (Frobenius norm). Adam divides each gradient element by its
    own running RMS, so float rounding in a gradient element near adam_eps becomes a visible change
    of that one weight element: element-wise relative error is not meaningful there; a layout bug
    (a wrong slice, a missing reduction) moves whole tensors by O(1)."""
    assert got.keys() == ref.keys(), f"{what}: parameter names differ"
    for k, w in ref.items():
        rel = ((got[k].double() - w.double()).norm() / w.double().norm()).item()
        assert rel <= RTOL, f"{what} {k}: relative difference {rel:.2e} > {RTOL}"


def _close(a, b, what):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    rel = ((a - b).abs() / b.abs().clamp_min(1e-12)).max().item()
    assert rel <= RTOL, f"{what}: max relative difference {rel:.2e} > {RTOL}"
    return rel


@pytest.mark.dist
def test_gradient_accumulation_matches(pool1, reference, tmp_path):
    """4 micro-batches of 2 sequences == 1 micro-batch of 8 (per-token loss over the global batch)."""
    got = pool1.run(train_and_collect, ["train.micro_batch_size=2"], str(tmp_path), STEPS)[0]
    _close(got["loss"], reference["loss"], "4 micro-batches losses")
    _close(got["grad_norm"], reference["grad_norm"], "4 micro-batches grad norms")
    _close_weights(got["weights"], reference["weights"], "4 micro-batches")


@pytest.mark.dist
def test_uneven_pipeline_split_matches(pool1, pool2, tmp_path):
    """6 layers over pp=2 x vp=2: megatron's split counting the embedding and the loss as layers."""
    six = ["model.num_layers=6"]
    ref = pool1.run(
        train_and_collect, six + ["train.micro_batch_size=8"], str(tmp_path / "ref"), 3
    )[0]
    results = pool2.run(
        train_and_collect, six + ["parallel.pp=2", "parallel.vp=2"], str(tmp_path / "pp"), 3
    )
    _close(results[0]["loss"], ref["loss"], "uneven pp2 x vp2 losses")
    _close_weights(merge_weights(results), ref["weights"], "uneven pp2 x vp2")


@pytest.mark.dist
@pytest.mark.parametrize("overrides", [["parallel.tp=2", "parallel.sp=true"], ["parallel.pp=2"]])
def test_output_layer_runs_at_the_target_positions(pool2, tmp_path, overrides):
    """models/target_logits.py under SP (gather, pick, output layer without SP for that call, SP
    back on after) and on the last pipeline stage: one row per target token."""
    from tests.support.layouts import picked_rows_case

    results = pool2.run(picked_rows_case, overrides, str(tmp_path))
    last = [r for r in results if r["seen"]]
    assert last, "no rank ran the output layer"
    for r in last:
        assert [n for n, _ in r["seen"]] == r["targets"], r
        assert not any(sp for _, sp in r["seen"])  # the call ran without SP
        assert r["sp_after"] == ("parallel.sp=true" in overrides)
