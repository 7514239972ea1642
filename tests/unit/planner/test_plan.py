"""The planner's contracts: CLI and JSON, the fit check, exp files, parameter counts, memory rules."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ftcore import planner
from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.planner import memory, params
from ftcore.planner.memory import GiB
from ftcore.planner.search import search

BIG = ["8b_lora", "70b_lora", "70b_fp8", "70b_full", "405b_lora", "405b_full", "qwen25_72b_lora"]
KEYS = {"memory_gib", "stages", "fits", "num_gpus", "gpus_needed", "tokens_per_s_per_gpu",
        "model_tflops_per_gpu", "mfu"}  # fmt: skip


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ftcore.plan", *args], capture_output=True, text=True, timeout=300
    )


def test_json_is_one_object_with_the_design_keys():
    r = plan_cli("+exp=70b_fp8", "plan.format=json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object on stdout
    assert KEYS <= set(out)
    assert set(out["memory_gib"]) >= {"weights", "grads", "optimizer", "activations", "total"}
    assert len(out["stages"]) == 4 and out["num_gpus"] == 8 and out["fits"] is True
    worst = max(s["memory_gib"]["total"] for s in out["stages"])
    assert out["memory_gib"]["total"] == pytest.approx(worst)


def test_exit_0_when_it_does_not_fit_and_2_on_config_errors():
    r = plan_cli("+exp=70b_full", "cluster=h100", "plan.format=json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["fits"] is False
    assert plan_cli("+exp=70b_full", "parallel.pp=3").returncode == 2  # 80 layers over 3 stages
    long = plan_cli("+exp=70b_lora", "data.seq_len=131072")  # llama3_70b has 8192 positions
    assert long.returncode == 2 and "ftcore error: data.seq_len:" in long.stderr
    assert plan_cli("+exp=70b_full", "no_such.key=1").returncode == 2


def test_table_names_every_term():
    r = plan_cli("+exp=405b_lora")
    assert r.returncode == 0, r.stderr
    for word in (
        "weights",
        "grads",
        "optimizer",
        "activations",
        "reserve",
        "fits: yes",
        "tokens/s/GPU",
    ):
        assert word in r.stdout


@pytest.mark.parametrize("exp", BIG)
def test_big_experiments_fit_their_cluster(exp):
    cfg = compose([f"+exp={exp}"])
    assert cfg.cluster.device == "cuda" and cfg.cluster.num_gpus
    planner.check_fit(cfg, cfg.cluster.num_gpus)
    p = planner.plan(cfg)
    assert p["fits"] and p["gpus_needed"] <= cfg.cluster.num_gpus


def test_check_fit_names_stage_total_and_largest_term():
    cfg = compose(["+exp=70b_full", "cluster=h100"])
    with pytest.raises(FtcoreError) as e:
        planner.check_fit(cfg, 8)
    msg = str(e.value)
    assert "pipeline stage 0" in msg and "GiB" in msg and "largest term: optimizer" in msg
    planner.check_fit(compose(["+exp=70b_full", "cluster=h100", "plan.enforce=false"]), 8)


@pytest.mark.parametrize(
    "model,billions",
    [("llama2_7b", 6.738), ("llama3_8b", 8.030), ("llama3_70b", 70.554), ("llama31_405b", 405.853)],
)
def test_parameter_counts_match_the_published_models(model, billions):
    assert params.total_params(compose([f"model={model}"])) / 1e9 == pytest.approx(
        billions, abs=1e-3
    )


@pytest.mark.parametrize(
    "model,count",
    # total_size / 2 of each bf16 checkpoint's model.safetensors.index.json on the Hub
    [("qwen25_72b", 72_706_203_648), ("qwen3_32b", 32_762_123_264),
     ("mistral_large_123b", 122_610_069_504)],
)  # fmt: skip
def test_family_parameter_counts_are_exact(model, count):
    """q/k/v biases (Qwen2) and [head_dim] q/k norms with head_dim != hidden / heads (Qwen3)."""
    assert params.total_params(compose([f"model={model}"])) == count


def test_distributed_optimizer_shards_the_optimizer_over_dp():
    base = ["+exp=70b_full", "parallel.tp=8", "parallel.pp=1"]
    one = memory.model_state(compose(base), 0, 1)
    four = memory.model_state(compose(base), 0, 4)
    assert four["optimizer"] == pytest.approx(one["optimizer"] / 4, rel=1e-4)
    assert four["grads"] == pytest.approx(one["grads"], rel=1e-6)
    plain = memory.model_state(compose([*base, "parallel.distributed_optimizer=false"]), 0, 4)
    assert plain["optimizer"] == pytest.approx(one["optimizer"], rel=1e-6)
    # bf16 weights + bf16 grads (70b_full: perf.grad_reduce_dtype=bf16) + fp32 main params + two
    # fp32 moments: 16 bytes per parameter; fp32 grad buffers add 2
    assert (one["weights"] + one["grads"] + one["optimizer"]) / one["elements"] == pytest.approx(
        16, rel=1e-3
    )
    fp32 = memory.model_state(compose([*base, "perf.grad_reduce_dtype=fp32"]), 0, 1)
    assert (fp32["weights"] + fp32["grads"] + fp32["optimizer"]) / fp32[
        "elements"
    ] == pytest.approx(18, rel=1e-3)


def test_lora_base_has_no_grads_or_optimizer_state():
    s = memory.model_state(compose(["+exp=70b_lora"]), 0, 1)
    assert s["grads"] < 0.01 * s["weights"] and s["frozen"] > 0.99 * s["weights"]


def test_fp8_base_storage_and_qlora_shrink_the_weights():
    bf16 = memory.model_state(compose(["+exp=405b_lora", "precision=bf16"]), 0, 1)["weights"]
    fp8 = memory.model_state(compose(["+exp=405b_lora"]), 0, 1)["weights"]
    cached = memory.model_state(
        compose(["+exp=405b_lora", "precision.fp8_param_gather=false"]), 0, 1
    )["weights"]
    nf4 = memory.model_state(compose(["+exp=405b_lora", "peft=qlora", "precision=bf16"]), 0, 1)[
        "weights"
    ]
    assert nf4 < fp8 < bf16 < cached  # NF4 < FP8 storage < BF16 < BF16 + TE's FP8 copy
    hopper = memory.model_state(
        compose(["+exp=405b_lora", "cluster=h200", "cluster.num_gpus=8"]), 0, 1
    )
    assert hopper["weights"] > fp8  # Hopper keeps a transposed FP8 copy for the backward GEMM


def test_uneven_split_puts_embedding_and_loss_on_lighter_stages():
    cfg = compose(["+exp=405b_full"])
    stages = memory.all_stages(cfg, 128)
    layers = [s.layers for s in stages]
    assert sum(layers) == 126 and layers[0] == layers[-1] == 7 and set(layers[1:-1]) == {8}


def test_recompute_and_sequence_parallel_cut_activations():
    base = ["+exp=70b_lora"]
    act = {
        rc: memory.stage_memory(compose([*base, f"parallel.recompute={rc}"]), 8, 0).parts[
            "saved_activations"
        ]
        for rc in ("none", "selective", "full")
    }
    assert act["full"] < act["selective"] < act["none"]
    no_sp = memory.stage_memory(compose([*base, "parallel.sp=false"]), 8, 0).parts[
        "saved_activations"
    ]
    assert no_sp > act["none"]


def test_search_ranks_only_layouts_that_fit():
    cfg = compose(["+exp=70b_fp8"])
    ranked = search(cfg, 8, top=5)
    assert ranked and all(r["memory_gib"] <= cfg.cluster.gpu_mem_gib for r in ranked)
    speeds = [r["tokens_per_s_per_gpu"] for r in ranked]
    assert speeds == sorted(speeds, reverse=True)


def test_search_rows_are_distinct_and_their_overrides_select_them():
    """Issue 31: no two rows are the same tp/pp/cp within 2% of each other's speed; each row's
    overrides, pasted after the exp, give a plan with that row's memory and speed; the table has
    an sp column and calls full fine-tuning "full"."""
    from ftcore.planner.report import table

    exp = ["+exp=70b_full"]
    cfg = compose(exp)
    ranked = search(cfg, 8, top=10)
    assert len(ranked) >= 3
    for i, a in enumerate(ranked):
        for b in ranked[i + 1 :]:
            same = all(a[k] == b[k] for k in ("tp", "pp", "cp"))
            assert not (same and b["tokens_per_s_per_gpu"] >= 0.98 * a["tokens_per_s_per_gpu"])
    assert sum(r["variants"] for r in ranked) > len(ranked)  # something was collapsed
    for r in ranked[:3]:
        p = planner.plan(compose([*exp, *r["overrides"].split()]), 8)
        assert p["memory_gib"]["total"] == pytest.approx(r["memory_gib"], rel=1e-9)
        assert p["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s_per_gpu"], rel=1e-9)
    text = table(planner.plan(cfg, 8), ranked)
    assert text.startswith("plan: llama3_70b full ")
    assert " sp " in text and ranked[0]["overrides"] in text


def test_every_number_says_what_it_rests_on():
    """Issue 31: measured, fitted or assumed, per kind of number; a borrowed calibration and a
    constant the user set are named."""
    b200 = planner.plan(compose(["+exp=405b_lora", "cluster=b200"]))["labels"]
    assert b200["speed"].startswith("assumed:") and "GB200" in b200["speed"]
    assert (
        b200["activations"].startswith("assumed:")
        and "not yet measured on a GPU" in b200["activations"]
    )
    assert b200["hardware_rates"] == "datasheet: conf/cluster/b200.yaml"
    h100 = planner.plan(compose(["+exp=70b_fp8", "cluster=h100", "cluster.matmul_efficiency=0.5"]))
    assert h100["labels"]["speed"].startswith("fitted:")
    assert h100["labels"]["speed"].endswith("set by you: matmul_efficiency")
    cpu = planner.plan(compose(["+exp=tiny_lora"]))["labels"]
    assert cpu["activations"].startswith("measured:") and cpu["hardware_rates"].startswith(
        "measured:"
    )
    assert all(
        v.split(":")[0] in ("measured", "fitted", "assumed", "datasheet") for v in cpu.values()
    )


def test_plan_command_as_a_user_types_it():
    """Issue 31 from the command line: the search table and the labels; CPU MFU below 1."""
    r = plan_cli("+exp=70b_full", "plan.search=true")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert out.startswith("plan: llama3_70b full ") and "what the numbers rest on:" in out
    assert "    tp  pp  vp  cp  dp  sp mbs" in out and "      parallel.tp=" in out
    j = plan_cli("+exp=tiny_lora", "plan.format=json")
    assert j.returncode == 0, j.stderr[-2000:]
    p = json.loads(j.stdout)
    assert 0 < p["mfu"] < 1 and "probed" in p["mfu_basis"]
    assert set(p["labels"]) == {"model_state", "activations", "reserve", "hardware_rates", "speed"}


def test_lora_plan_agrees_with_the_peft_module():
    from ftcore.peft.config import plan_targets

    for targets in (
        ["linear_qkv"],
        ["q_proj", "v_proj", "down_proj"],
        ["linear_fc1", "o_proj", "k_proj"],
    ):
        cfg = compose(["+exp=tiny_full", "peft=lora", f"peft.target_modules=[{','.join(targets)}]"])
        assert params.lora_plan(cfg) == plan_targets(targets)


def test_seed_claim_70b_on_one_192gb_gpu():
    """'One 192 GB GPU holds a 70B model': its weights yes (BF16), weights+grads+Adam no."""
    cfg = compose(
        [
            "+exp=70b_full",
            "parallel.tp=1",
            "parallel.pp=1",
            "parallel.sp=false",
            "cluster.num_gpus=1",
        ]
    )
    s = memory.model_state(cfg, 0, 1)
    assert s["weights"] < 192e9 < s["weights"] + s["grads"] + s["optimizer"]
    assert (s["weights"] + s["grads"] + s["optimizer"]) / GiB > 1000


def test_train_refuses_a_job_predicted_not_to_fit(tmp_path):
    """ftcore.train runs the fit check before building anything: exit 2, one line, the stage."""
    r = subprocess.run(
        [sys.executable, "-m", "ftcore.train", "+exp=tiny_full", "cluster.gpu_mem_gib=0.3",
         f"run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "predicted out of memory: pipeline stage 0" in r.stderr and "Traceback" not in r.stderr


def test_last_layer_attention_picks_only_where_the_runtime_does():
    """SdpaAttention attends only the target rows when they are at most half the slots
    (models/attention.py), else every row while the MLP still picks: the planner follows, so a
    0.6 target fraction saves the MLP's bytes only and 0.3 the attention's too."""
    from ftcore.planner import activations as act

    def shape(frac: float):
        return act.shape_of(compose(["+exp=tiny_lora", f"plan.target_fraction={frac}"]))

    many, few = shape(0.6), shape(0.3)
    assert many.mlp_picks and not many.attn_picks
    assert few.mlp_picks and few.attn_picks
    mlp_only = act.last_layer_saving(act.Shape(**{**vars(few), "attn_picks": False}))
    assert act.last_layer_saving(few) > mlp_only > 0


def test_headroom_is_kept_free_and_each_row_shows_its_spare():
    """plan.headroom (default 0.10: the planner's measured activation error) of the activations is
    kept free: a GPU just bigger than the predicted total does not fit; headroom 0 does."""
    from ftcore.config.schema import compose as _compose
    from ftcore.planner import plan as _plan
    from ftcore.planner.report import table

    base = ["+exp=tiny_lora", "cluster.num_gpus=1"]
    p = _plan(_compose(base))
    assert p["headroom_gib"] == pytest.approx(0.10 * p["memory_gib"]["activations"])
    snug = p["memory_gib"]["total"] + 0.5 * p["headroom_gib"]
    tight = _plan(_compose(base + [f"cluster.gpu_mem_gib={snug}"]))
    assert not tight["fits"] and tight["spare_gib"] == pytest.approx(0.5 * p["headroom_gib"])
    assert _plan(_compose(base + [f"cluster.gpu_mem_gib={snug}", "plan.headroom=0"]))["fits"]
    text = table(p, [dict(tp=1, pp=1, vp=1, cp=1, dp=1, sp=False, micro_batch_size=4,
                          recompute="none", memory_gib=1.0, spare_gib=23.0,
                          tokens_per_s_per_gpu=1.0, mfu=0.1, variants=1, overrides="x")])  # fmt: skip
    assert "the config's layout (above) fits: yes" in text and "spare" in text
    assert "search: the layouts on 1 GPUs that fit" in text and "  23.0" in text
