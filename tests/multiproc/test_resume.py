"""Resume inside the pool: bitwise on the same layout, 1e-5 after resharding TP=2 -> 1, PP=2 -> 1
(the distributed optimizer too: TP=2 or PP=2 -> DP=2 and back).

The uninterrupted run trains 4 steps; the interrupted one trains 2, saves, is built afresh
(new model, optimizer, loader: everything comes from the checkpoint) and trains 2 more."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ftcore.checkpoint import store
from tests.support.ckpt_cases import build_resumed, train
from tests.support.layouts import full_weights, merge_weights

RTOL = 1e-5


def uninterrupted(overrides: list[str], run_dir: str, steps: int) -> dict:
    state = build_resumed(overrides, run_dir, resume="never")
    return {"loss": train(state, steps), "weights": full_weights(state)}


def first_half(overrides: list[str], run_dir: str, steps: int) -> None:
    state = build_resumed(overrides, run_dir, resume="never")
    train(state, steps)
    store.save(state)


def second_half(overrides: list[str], run_dir: str, steps: int) -> dict:
    state = build_resumed(overrides, run_dir, resume="never")
    state.cfg.checkpoint.resume = "auto"
    notes = store.load(state, store.resolve(state))
    start = state.step
    return {
        "start": start,
        "notes": notes,
        "loss": train(state, steps),
        "weights": full_weights(state),
    }


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The uninterrupted run and the checkpoint after the first half, per layout: several tests
    start from the same one (tp2, pp2, tp2 with the distributed optimizer), so each pair runs
    once here. Each test resumes from its own copy of the run directory."""
    done: dict[tuple[str, ...], tuple[list, Path]] = {}

    def get(pool, before: list[str]) -> tuple[list, Path]:
        key = tuple(before)
        if key not in done:
            d = tmp_path_factory.mktemp("started")
            ref = pool.run(uninterrupted, before, str(d / "ref"), 4)
            pool.run(first_half, before, str(d / "run"), 2)
            done[key] = (ref, d / "run")
        return done[key]

    return get


def _run(pool, started, tmp_path, before: list[str], after: list[str]) -> tuple[dict, dict]:
    ref, first = started(pool, before)
    shutil.copytree(first, tmp_path / "run")
    got = pool.run(second_half, after, str(tmp_path / "run"), 2)
    assert all(g["start"] == 2 for g in got)
    ref_w, got_w = merge_weights(ref), merge_weights(got)
    assert ref_w.keys() == got_w.keys()
    return {"loss": ref[0]["loss"][2:], "weights": ref_w}, {"loss": got[0]["loss"], "weights": got_w,
                                                           "notes": got[0]["notes"]}  # fmt: skip


@pytest.mark.dist
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tp=2"],
        ["parallel.pp=2"],
        ["parallel.tp=2", "parallel.distributed_optimizer=true"],
    ],
    ids=["tp2", "pp2", "tp2_distopt"],
)
def test_resume_is_bitwise(pool2, started, tmp_path, layout):
    ref, got = _run(pool2, started, tmp_path, layout, layout)
    assert got["loss"] == ref["loss"]  # exact float equality
    for k, w in ref["weights"].items():
        assert torch.equal(got["weights"][k], w), k
    assert got["notes"] == []


def _assert_continues(ref: dict, got: dict) -> None:
    a, b = (
        torch.tensor(got["loss"], dtype=torch.float64),
        torch.tensor(ref["loss"], dtype=torch.float64),
    )
    assert ((a - b).abs() / b.abs()).max().item() <= RTOL, (got["loss"], ref["loss"])
    # Weights: 1e-4 of each tensor's scale. Adam divides each gradient by its own running RMS, so
    # float rounding in a near-zero gradient (rare tokens' embedding rows) becomes an lr-sized
    # change of that element; a lost or mis-sharded moment would differ by ~lr (2e-3) instead.
    for k, w in ref["weights"].items():
        diff = (got["weights"][k].double() - w.double()).abs().max().item()
        assert diff <= 10 * RTOL * w.double().abs().max().item(), k


@pytest.mark.dist
@pytest.mark.parametrize(
    "before,after",
    [(["parallel.tp=2"], []), (["parallel.pp=2"], [])],
    ids=["tp2_to_tp1", "pp2_to_pp1"],
)
def test_reshard_continues(pool2, started, tmp_path, before, after):
    """Weights and (model-space) Adam moments reshard; RNG states cannot and are said not to be."""
    ref, got = _run(pool2, started, tmp_path, before, after)
    _assert_continues(ref, got)
    assert any("RNG states not restored" in n for n in got["notes"])


UNEVEN = ["parallel.pp=2", "parallel.pp_first_stage_layers=1", "parallel.pp_last_stage_layers=3"]


@pytest.mark.dist
def test_resume_at_another_pipeline_split(pool2, started, tmp_path):
    """Saved at pp=2 as 2 + 2 layers, resumed as 1 + 3 (uneven stages): megatron's checkpoint keys
    each layer by its global number, so layer 1 moves from stage 0 to stage 1 with its weights
    and Adam moments."""
    ref, got = _run(pool2, started, tmp_path, ["parallel.pp=2"], UNEVEN)
    _assert_continues(ref, got)
    assert not any("optimizer state not restored" in n for n in got["notes"]), got["notes"]


DIST_OPT = "parallel.distributed_optimizer=true"
LORA = ["peft=lora", "peft.target_modules=[q_proj,v_proj,o_proj,down_proj]"]


@pytest.mark.dist
@pytest.mark.parametrize(
    "before,after",
    [
        (["parallel.tp=2"], []),
        (["parallel.pp=2"], []),
        ([], ["parallel.pp=2"]),
        (["parallel.tp=2", *LORA], LORA),
        (["parallel.cp=2"], []),
    ],
    ids=["tp2_to_dp2", "pp2_to_dp2", "dp2_to_pp2", "lora_tp2_to_dp2", "cp2_to_dp2"],
)
def test_distributed_optimizer_reshards(pool2, started, tmp_path, before, after):
    """The distributed optimizer's state (Adam moments, fp32 main params) reshards across TP, PP
    and DP: TP=2 (DP=1, every rank holds half of each TP-split tensor's state) resumed at
    TP=1 x DP=2 (each rank holds half of the flat buffer) continues with the uninterrupted losses.
    CP=2 (DP=1: the state is sharded over dp x cp = 2) resumes at CP=1 x DP=2."""
    ref, got = _run(pool2, started, tmp_path, [*before, DIST_OPT], [*after, DIST_OPT])
    _assert_continues(ref, got)
    assert not any("optimizer state not restored" in n for n in got["notes"]), got["notes"]


def old_format_first_half(overrides: list[str], run_dir: str, steps: int) -> None:
    """A checkpoint as ftcore wrote it before: the distributed optimizer in megatron's
    dp_reshardable format (its raw DP buffers)."""
    from ftcore.checkpoint import resume

    current = resume.optim_format
    resume.optim_format = lambda cfg: "dp_reshardable" if cfg.parallel.distributed_optimizer else current(cfg)  # fmt: skip
    try:
        first_half(overrides, run_dir, steps)
    finally:
        resume.optim_format = current


@pytest.mark.dist
def test_old_dp_reshardable_checkpoint(pool2, started, tmp_path):
    """A checkpoint in the older dp_reshardable format still loads whole at its own layout (and
    the run continues bit for bit); at another TP/PP the weights load and a warning says the
    moments restart."""
    tp2 = ["parallel.tp=2", DIST_OPT]
    ref, _ = started(pool2, tp2)  # its uninterrupted run (it saves nothing: any format)
    pool2.run(old_format_first_half, tp2, str(tmp_path / "run"), 2)
    same = pool2.run(second_half, tp2, str(tmp_path / "run"), 2)
    assert same[0]["loss"] == ref[0]["loss"][2:] and same[0]["notes"] == []
    other = pool2.run(second_half, [DIST_OPT], str(tmp_path / "run"), 1)
    assert other[0]["start"] == 2
    assert any("older dp_reshardable format" in n and "tp=2" in n for n in other[0]["notes"])


def te_adam_case(overrides: list[str], run_dir: str) -> dict:
    """With TE's FusedAdam as megatron's inner optimizer (a CPU stand-in with its checkpoint
    contract: tests/support/te_fused_adam.py): 4 steps straight, and 2 + save + resume + 2 with a
    save after each resumed step (every later save must work too)."""
    from tests.support.te_fused_adam import FusedAdamStandIn, megatron_with_te_adam

    with megatron_with_te_adam():
        state = build_resumed(overrides, f"{run_dir}/ref", resume="never")
        assert isinstance(state.optimizer.optimizer, FusedAdamStandIn)
        ref = train(state, 4)
        first_half(overrides, f"{run_dir}/run", 2)
        got = second_half(overrides, f"{run_dir}/run", 0)
        state = build_resumed(overrides, f"{run_dir}/run", resume="auto")
        loss = train(state, 2, save_every=1)
    return {"ref": ref, "loss": loss, "start": got["start"], "notes": got["notes"]}


@pytest.mark.dist
def test_distributed_optimizer_resumes_with_te_fused_adam(pool2, tmp_path):
    """Issue 41, item 1: resume gave TE's FusedAdam a per-parameter `step`, which its
    state_dict() cannot name (KeyError, reported as 'could not be loaded'), and every later save
    failed too. DP=2 with the distributed optimizer: resumed losses are the uninterrupted ones."""
    got = pool2.run(te_adam_case, [DIST_OPT], str(tmp_path))
    for g in got:
        assert g["start"] == 2 and g["notes"] == [], g
        assert g["loss"] == g["ref"][2:], (g["loss"], g["ref"])
