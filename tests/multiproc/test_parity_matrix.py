"""The parity matrix (tests/support/matrix.py, docs/parallelism.md): each run is what
`python -m ftcore.train` does once launched (ftcore/train.py: compose, setup, fit) on 2 or 4 of
the session's gloo ranks, held to the one-process run of the same command without its layout,
optimizer-sharding and recompute keys (on the session's one-rank pool).

Per step: the same tokens (the promise), losses to 1e-5 (fp32), DPO's log-probs to 1e-5 and its
rewards to 1e-5 of what they are made of (beta x a difference of two log-prob sums of ~40: within
1e-5 x beta x |log-prob|), MoE's auxiliary loss and expert load to 1e-5, gradient norms to 1e-4
(summed in another order by layout); the evaluation at the end to 1e-5. The exported weights
(hf_model/ or hf_adapter/) to 1e-2 of each tensor's norm: a guard against a layout bug, which moves
whole tensors by O(1). Adam's first updates are ~lr x the sign of each gradient element, so an
element whose gradients nearly cancel turns rounding into a visible move: measured 3.5e-3 in one
lora_B of a DPO run at PP=2 x VP=2 x CP=2 whose losses agree to 7e-7, and 2e-4 from micro-batching
alone (train.micro_batch_size 2 -> 1, one process). And what megatron ran with is what the run
asked for (sizes, SP, the distributed optimizer and its overlaps, recompute). The pairs ftcore
refuses are refused before anything is built (exit 2).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ftcore.errors import FtcoreError
from tests.support import matrix
from tests.support.cli import cli, error_line
from tests.support.deepseek import make_tiny
from tests.support.moe import make_tiny_moe

RTOL = 1e-5
GRAD_RTOL = 1e-4
WEIGHT_RTOL = 1e-2
DPO_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
LOGP_KEYS = ("logps/chosen", "logps/rejected")
MOE_KEYS = ("aux_loss", "expert_load_max_over_mean", "expert_bias_shift")
RUNS = matrix.runs()
EXPERTS = {"dense": 0, "moe": 4, "deepseek": 8}


def train_case(argv: list[str], run_dir: str) -> dict:
    """Worker: ftcore/train.py's task once launched (no launcher, no process-group teardown: the
    pool keeps its group); what megatron ran with."""
    from megatron.core import parallel_state as ps

    from ftcore.config.schema import compose
    from ftcore.models.sharding import unwrap
    from ftcore.training import trainer
    from ftcore.validation import preflight

    cfg = compose([*argv, f"run.dir={run_dir}"])
    preflight.use_adapter(cfg, training=True)
    state = trainer.setup(cfg)
    trainer.fit(state)
    config, ddp = unwrap(state.model[0]).config, state.model[0].ddp_config
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vp": len(state.model),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "sp": bool(config.sequence_parallel),
        "distributed_optimizer": ddp.use_distributed_optimizer,
        "overlap_grad_reduce": ddp.overlap_grad_reduce,
        "overlap_param_gather": ddp.overlap_param_gather,
        "overlap_p2p_comm": bool(config.overlap_p2p_comm),
        "recompute": config.recompute_granularity or "none",
        "experts": config.num_moe_experts or 0,
        # the global numbers (1-based) of the layers each model chunk of this rank built
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "layers": [[x.layer_number for x in unwrap(m).decoder.layers] for m in state.model],
    }


def _read(run_dir: Path, flags: dict) -> dict:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    keys = ("loss", "grad_norm", "tokens", *DPO_KEYS, *LOGP_KEYS, *MOE_KEYS)
    out = {k: [x[k] for x in steps] for k in keys if k in steps[0]}
    out["eval_loss"] = [x["eval_loss"] for x in lines if "eval_loss" in x]
    hf = next(p for p in (run_dir / "hf_model", run_dir / "hf_adapter") if p.is_dir())
    out["weights"] = {}
    for f in sorted(hf.glob("*.safetensors")):
        out["weights"].update(load_file(f))
    return out | {"flags": flags}


@pytest.fixture(scope="module")
def paths(pool1, tmp_path_factory) -> dict[str, str]:
    """{moe}, {deepseek}: random Qwen3-MoE and DeepSeek-V3 checkpoints of transformers; {adapter}:
    a reference adapter, the hf_adapter/ of a LoRA SFT run of the dense model (the table's own
    LoRA settings)."""
    moe = make_tiny_moe(tmp_path_factory.mktemp("moe") / "qwen3_moe")
    deepseek = make_tiny(tmp_path_factory.mktemp("deepseek") / "deepseek_v3", seed=3)
    d = tmp_path_factory.mktemp("ref_adapter")
    sft = {
        "model": "dense",
        "objective": "sft",
        "loss": "next_token",
        "peft": "lora",
        "rows": "packed",
    }
    argv = matrix.reference_command(matrix.reference_key(sft), {})
    pool1.run(train_case, argv, str(d))
    return {"moe": str(moe), "deepseek": str(deepseek), "adapter": str(d / "hf_adapter")}


@pytest.fixture(scope="module")
def references(pool1, paths, tmp_path_factory):
    """One one-process run per WHAT key, made when a run first needs it."""
    cache: dict[tuple, dict] = {}

    def get(key: tuple) -> dict:
        if key not in cache:
            d = tmp_path_factory.mktemp("ref-" + "-".join(key).replace("+", "_"))
            flags = pool1.run(train_case, matrix.reference_command(key, paths), str(d))[0]
            cache[key] = _read(d, flags)
        return cache[key]

    return get


def _close(got, ref, what: str, rtol: float = RTOL, atol: float = 0.0) -> None:
    assert len(got) == len(ref), f"{what}: {got} vs {ref}"
    for g, r in zip(got, ref):
        assert math.isclose(g, r, rel_tol=rtol, abs_tol=atol), f"{what}: {got} vs {ref} ({rtol})"


def _asked(run: dict) -> dict:
    """What megatron should run with for this run's settings."""
    opt, tp, pp = run["optimizer"], run["tp"], run["pp"]
    return {
        "tp": 1 if tp == "1" else 2, "pp": 1 if pp == "1" else 2, "vp": 2 if pp == "2xvp2" else 1,
        "cp": int(run["cp"]), "ep": int(run["ep"]), "sp": tp == "2+sp",
        "distributed_optimizer": opt != "plain", "overlap_grad_reduce": opt == "overlap",
        "overlap_param_gather": opt == "overlap",
        "overlap_p2p_comm": opt == "overlap" and pp == "2xvp2",  # interleaving's own
        "recompute": run["recompute"],
    }  # fmt: skip


# the layers each pipeline rank builds, by its chunks: 2uneven is 1 + 3 (every model has 4)
STAGES = {
    "1": {0: [[1, 2, 3, 4]]},
    "2uneven": {0: [[1]], 1: [[2, 3, 4]]},
    "2xvp2": {0: [[1], [3]], 1: [[2], [4]]},
}


def _weights(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for k, w in ref.items():
        diff = (got[k].double() - w.double()).norm().item()
        assert diff <= WEIGHT_RTOL * w.double().norm().item(), f"{k}: |diff| {diff:.2e}"


@pytest.mark.dist
@pytest.mark.parametrize("run", RUNS, ids=[matrix.name(r) for r in RUNS])
def test_run_matches_its_one_process_reference(run, request, paths, references, tmp_path):
    ref = references(matrix.reference_key(run))
    pool = request.getfixturevalue(f"pool{matrix.world(run)}")
    ranks = pool.run(train_case, matrix.command(run, paths), str(tmp_path / "run"))
    flags = ranks[0]
    got = _read(tmp_path / "run", flags)
    asked = _asked(run)
    assert {k: flags[k] for k in asked} == asked, "the layout keys did not reach megatron"
    assert {r["pp_rank"]: r["layers"] for r in ranks} == STAGES[run["pp"]], "the pipeline split"
    assert flags["experts"] == ref["flags"]["experts"] == EXPERTS[run["model"]]
    assert len(got["loss"]) == matrix.STEPS
    assert got["tokens"] == ref["tokens"], "the layout changed the documents a step trains on"
    _close(got["loss"], ref["loss"], "losses")
    _close(got["grad_norm"], ref["grad_norm"], "grad norms", GRAD_RTOL)
    _close(got["eval_loss"], ref["eval_loss"], "evaluation loss")
    if "rewards/chosen" in ref:
        beta = 0.1  # objective.beta: the table keeps the default
        scale = max(abs(x) for k in LOGP_KEYS for x in ref[k])
        for k in DPO_KEYS:
            _close(got[k], ref[k], k, atol=RTOL * beta * scale)
    for k in (*LOGP_KEYS, *MOE_KEYS):
        if k in ref:
            _close(got[k], ref[k], k)
    _weights(got["weights"], ref["weights"])


def test_dpo_references_start_at_log2(references):
    """The one-process DPO runs themselves: the policy starts as its reference (the adapters' B at
    zero, the reference adapter loaded into the policy, the frozen copy, the stored first pass),
    so the sigmoid loss is log 2 and both rewards 0 at step 1; then the policy moves."""
    keys = {matrix.reference_key(r) for r in RUNS}
    dpo = [k for k in keys if dict(zip(matrix.WHAT, k))["loss"] == "sigmoid"]
    assert {dict(zip(matrix.WHAT, k))["objective"] for k in dpo} >= {"dpo", "dpo_ref_adapter"}
    for key in sorted(dpo):
        ref = references(key)
        assert math.isclose(ref["loss"][0], math.log(2), rel_tol=1e-6), (key, ref["loss"])
        # exactly 0 but for precompute_ref, whose stored pass sums in another order (~4e-8)
        assert abs(ref["rewards/chosen"][0]) + abs(ref["rewards/rejected"][0]) <= 1e-6, key
        assert abs(ref["rewards/margins"][-1]) > 1e-4, (key, "the policy did not move")


def test_moe_references_route_and_balance(references):
    """The one-process MoE runs themselves (4 experts, top-2, 3 MoE layers of 4): a positive
    auxiliary loss near coeff x layers (about 0.3 when balanced) and an expert load between
    balance and the worst possible (E/k = 2)."""
    keys = sorted({matrix.reference_key(r) for r in RUNS if r["model"] == "moe"})
    assert len(keys) >= 2
    for key in keys:
        ref = references(key)
        assert all(0.1 < a < 1.0 for a in ref["aux_loss"]), (key, ref["aux_loss"])
        assert all(1.0 <= x <= 2.0 for x in ref["expert_load_max_over_mean"]), key


def test_deepseek_references_move_the_expert_bias(references):
    """The one-process DeepSeek-V3 runs themselves: megatron's aux-loss-free balancing moves each
    expert's bias by the update rate (0.01) up or down at each step, so the largest move is 0.01
    after the first step and at most k x 0.01 after k; the expert load is between balance and the
    worst possible (E/k = 2)."""
    keys = sorted({matrix.reference_key(r) for r in RUNS if r["model"] == "deepseek"})
    assert len(keys) >= 2
    for key in keys:
        ref = references(key)
        shift = ref["expert_bias_shift"]
        assert math.isclose(shift[0], 0.01, rel_tol=1e-4), (key, shift)
        assert all(0 < x <= 0.01 * (k + 1) + 1e-6 for k, x in enumerate(shift)), (key, shift)
        assert all(1.0 <= x <= 2.0 for x in ref["expert_load_max_over_mean"]), key


def _holding(pair: tuple) -> dict[str, str]:
    """A valid run of the table's with one setting changed, so that it holds the refused pair and
    nothing else ruled out."""
    (f, a), (g, b) = pair
    for run in matrix._combos():
        for moved in ({**run, f: a}, {**run, g: b}):
            if matrix.refused(moved) == [pair] and not matrix.unfit(moved):
                return moved
    raise AssertionError(f"no run of the table is one setting away from {pair}")


@pytest.mark.parametrize("pair", list(matrix.REFUSED), ids=lambda p: f"{p[0][1]}-x-{p[1][1]}")
def test_refused_pairs_are_refused_before_anything_is_built(pair, paths):
    """What the launching parent checks before any worker starts (validation/checks.py)."""
    from ftcore.config.schema import compose
    from ftcore.validation import checks

    run = _holding(pair)
    cfg = compose(matrix.command(run, paths))
    with pytest.raises(FtcoreError) as e:
        checks.check_for_launch(cfg, matrix.world(run))
    assert e.value.field == matrix.REFUSED[pair][0], str(e.value)


def test_a_refused_pair_exits_2_through_the_command_line(paths, tmp_path):
    pair = (("model", "moe"), ("objective", "dpo"))
    run = _holding(pair)
    argv = [*matrix.command(run, paths), f"launcher.nproc_per_node={matrix.world(run)}"]
    line = error_line(cli("train", *argv, f"run.dir={tmp_path / 'run'}", timeout=120))
    assert line.startswith("ftcore error: objective:"), line
    assert not (tmp_path / "run").exists()
