"""The training state's timer hook (ftcore.training.timing): a step under PP 2 with the bench's
Timers in `state.timers` is split into its parts, the pipeline sends/receives timed by megatron's
own schedule; the evaluation loop, run after it, times nothing."""

from __future__ import annotations

import pytest

from tests.support.layouts import build


def timed_step_case(overrides: list[str], run_dir: str) -> dict:
    from ftcore.bench.worker import Timers
    from ftcore.training import evaluation, trainer

    state = build(overrides, run_dir)
    state.timers = timers = Timers()
    trainer.train_step(state)
    names = sorted(timers.t)
    parts = timers.take()
    config_timers_after = state.model[0].config.timers
    evaluation.evaluate(state, [state.loader.next_microbatches()])
    return {"names": names, "parts": parts, "config_timers_after": config_timers_after,
            "after_eval": dict(timers.t)}  # fmt: skip


@pytest.mark.dist
def test_a_pp2_step_is_split_with_megatrons_p2p_timers(pool2, tmp_path):
    from ftcore.bench.worker import PARTS

    for rank, r in enumerate(pool2.run(timed_step_case, ["parallel.pp=2"], str(tmp_path))):
        assert set(r["parts"]) == set(PARTS), r
        # the first stage sends activations forward, the last sends gradients back
        assert ("forward-send" if rank == 0 else "backward-send") in r["names"], r["names"]
        for part in PARTS:
            assert r["parts"][part] > 0, (rank, r["parts"])
        assert r["config_timers_after"] is None and r["after_eval"] == {}, r


@pytest.mark.dist
def test_without_pipeline_no_p2p_time(pool1, tmp_path):
    (r,) = pool1.run(timed_step_case, [], str(tmp_path))
    assert r["parts"]["pp_p2p"] == 0.0 and not any("send" in n or "recv" in n for n in r["names"])
    assert r["parts"]["fwd_bwd"] > 0 and r["parts"]["grad_sync"] > 0
