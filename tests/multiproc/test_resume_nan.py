"""Numerical faults: a NaN/Inf loss or gradient stops the run naming the step, before the update
and without a checkpoint of the bad state; train.skip_bad_steps=K skips up to K such steps
(the weights untouched by them) and goes on."""

from __future__ import annotations

import pytest
import torch

from ftcore.errors import FtcoreError
from ftcore.models.sharding import iter_params
from ftcore.training import trainer
from tests.support.ckpt_cases import build_resumed, latest, metric_lines


def fit_with_fault(overrides: list[str], run_dir: str, bad_call: int, kind: str) -> dict:
    """fit(); the `bad_call`-th batch fetch poisons that step: NaN grads (a hook on one weight)
    or an Inf loss (one weight set to Inf for that step, then put back)."""
    state = build_resumed(overrides, run_dir)
    name, param = next((n, p) for n, p in iter_params(state.model) if "linear_fc2" in n)
    inner, calls, hooks, seen = state.loader.next_microbatches, [0], [], {}

    def next_microbatches():
        calls[0] += 1
        for h in hooks:
            h.remove()
        hooks.clear()
        if "saved" in seen:
            param.data.copy_(seen.pop("saved"))
        if calls[0] == bad_call:
            seen["before"] = {n: p.detach().clone() for n, p in iter_params(state.model)}
            if kind == "grad":
                hooks.append(param.register_hook(lambda g: g * float("nan")))
            else:
                seen["saved"] = param.detach().clone()
                param.data.fill_(float("inf"))
        elif calls[0] == bad_call + 1 and "before" in seen:
            now = {n: p.detach() for n, p in iter_params(state.model)}
            seen["unchanged"] = all(torch.equal(now[n], b) for n, b in seen["before"].items())
        return inner()

    state.loader.next_microbatches = next_microbatches
    try:
        trainer.fit(state)
        error = None
    except FtcoreError as e:
        error = str(e)
    finite = all(bool(torch.isfinite(p).all()) for _, p in iter_params(state.model))
    return {
        "error": error,
        "step": state.step,
        "finite": finite,
        "unchanged": seen.get("unchanged"),
    }


OVER = ["train.max_steps=4", "checkpoint.interval=1", "checkpoint.keep=0"]


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["grad", "loss"])
def test_nan_stops_naming_the_step(pool2, tmp_path, kind):
    res = pool2.run(fit_with_fault, OVER, str(tmp_path), bad_call=3, kind=kind)
    for r in res:
        assert r["error"] and "non-finite loss or grad norm at step 3" in r["error"], r
    assert latest(tmp_path) == "step_2" and not (tmp_path / "checkpoints" / "step_3").exists()
    assert [m["step"] for m in metric_lines(tmp_path)] == [1, 2]
    if kind == "grad":
        assert all(r["finite"] for r in res)  # NaN grads never reached the weights


@pytest.mark.dist
def test_skip_bad_steps(pool2, tmp_path):
    res = pool2.run(
        fit_with_fault, OVER + ["train.skip_bad_steps=1"], str(tmp_path), bad_call=2, kind="grad"
    )
    for r in res:
        assert r["error"] is None and r["step"] == 4 and r["finite"] and r["unchanged"], r
    assert [m["step"] for m in metric_lines(tmp_path)] == [1, 2, 3, 4]
