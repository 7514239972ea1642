"""GRPO on every layout (issue 55): with the same seed, four LoRA GRPO steps (fp32; beta != 0, so
the reference pass runs; num_iterations=2, so the old log-probs are kept and the second update of
each rollout clips) at TP=2 (+SP, whose decoding recomputes the prefix), PP=2 and DP=2 (the
distributed optimizer, its parameter gather overlapped) sample the same completions, score the
same rewards and give the one-process losses, KL and entropy to 1e-5. Each run is the same config
with only the layout changed; ftcore's own decoder samples. The layouts run under the device
audit: no collective of a rollout or an update hands NCCL a host tensor."""

from __future__ import annotations

import math

import pytest

STEPS = 4
REWARDS = "tests.support.grpo_rewards"
LAYOUTS = {
    "tp2": ["parallel.tp=2", "parallel.sp=true"],
    "pp2": ["parallel.pp=2"],
    # the distributed optimizer with both overlaps: the decoder reads the gathered parameters
    "dp2": [
        "parallel.distributed_optimizer=true",
        "parallel.overlap_grad_reduce=true",
        "parallel.overlap_param_gather=true",
    ],
}
# the bundled tiny base (it stops its completions, a random one would not) and prompt set
BASE = ["+exp=tiny_lora", "objective=grpo", "data.packing=false", "data.seq_len=96",
        "eval.interval=0", "eval.accuracy=false", "checkpoint.interval=0",
        "checkpoint.save_at_end=false", "logger.progress=lines", "train.global_batch_size=8",
        "train.micro_batch_size=2", "objective.num_generations=4",
        "objective.max_completion_length=10", "objective.beta=0.04", "objective.num_iterations=2",
        "objective.temperature=1.0",
        f"objective.rewards=[{{fn: '{REWARDS}:length_reward'}}, {{fn: '{REWARDS}:token_sum_reward'}}, "
        "{fn: last_number, weight: 4.0}]",
        "peft.r=4", "peft.lora_alpha=8", "optim.lr=1e-2", "sched.warmup_steps=0",
        f"train.max_steps={STEPS}"]  # fmt: skip


def steps_case(overrides: list[str], run_dir: str, audit: bool = False) -> dict:
    """Worker: per step the loss and metrics; per rollout this rank's rows and completions. With
    `audit`, every collective must get the tensor the GPU path's backend takes
    (runtime/device_audit.py: NCCL, no host tensor)."""
    import contextlib

    from ftcore.config.schema import compose
    from ftcore.runtime import device_audit

    with device_audit.shadow_devices() if audit else contextlib.nullcontext():
        return _steps(compose([*overrides, f"run.dir={run_dir}"]))


def _steps(cfg) -> dict:
    from megatron.core import parallel_state as ps

    from ftcore.training import trainer

    state = trainer.setup(cfg)
    steps, rollouts = [], []
    while state.step < STEPS:
        r = trainer.train_step(state)
        state.step += 1
        steps.append({"loss": r["loss"], **r["metrics"]})
        batch = state.extra["grpo_batch"]
        if batch.uses == 1:
            rollouts.append({"completions": batch.completion_ids, "rewards": batch.rewards,
                             "prompt_lengths": [len(p) for p in batch.prompt_ids]})  # fmt: skip
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return {"steps": steps, "rollouts": rollouts, "dp": dp, "dp_rank": rank}


def _completions(results: list[dict]) -> list[list[list[int]]]:
    """Every rollout's completions in global row order, from the ranks of each DP replica."""
    dp = results[0]["dp"]
    first = {r["dp_rank"]: r for r in reversed(results)}  # one rank per replica
    out = []
    for t in range(len(results[0]["rollouts"])):
        out.append([c for d in range(dp) for c in first[d]["rollouts"][t]["completions"]])
    return out


@pytest.fixture(scope="module")
def reference(pool1, tmp_path_factory):
    return pool1.run(steps_case, BASE, str(tmp_path_factory.mktemp("grpo-ref")))


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_layout_parity(pool2, reference, tmp_path, layout):
    ref = reference
    got = pool2.run(steps_case, [*BASE, *LAYOUTS[layout]], str(tmp_path), audit=True)
    want = _completions(ref)
    assert len(want) == STEPS // 2
    assert _completions(got) == want  # the same tokens, row for row
    ragged = {n for r in ref for ro in r["rollouts"] for n in ro["prompt_lengths"]}
    assert len(ragged) > 1  # rows join the decoding at different positions
    assert min(len(c) for ro in want for c in ro) < 10  # and one leaves it: a stop token sampled
    for r in got:  # every rank holds the whole batch's rewards
        for t, rollout in enumerate(r["rollouts"]):
            assert rollout["rewards"] == ref[0]["rollouts"][t]["rewards"]
    for step, (g, w) in enumerate(zip(got[0]["steps"], ref[0]["steps"]), start=1):
        for k in ("loss", "kl", "entropy", "clip_ratio/region_mean"):
            assert math.isclose(g[k], w[k], rel_tol=1e-5, abs_tol=1e-6), (
                layout,
                step,
                k,
                g[k],
                w[k],
            )
    assert ref[0]["steps"][1]["clip_ratio/region_mean"] > 0  # the second update clipped
    assert ref[0]["steps"][1]["kl"] > 0
