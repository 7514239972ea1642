"""Config composition and the validation errors of Core I: exit 2, one line naming the field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ftcore.config.schema import compose, conf_dir
from ftcore.errors import FtcoreError
from ftcore.validation.checks import validate

EXPS = sorted(p.stem for p in (conf_dir() / "exp").glob("*.yaml"))


@pytest.mark.parametrize("exp", EXPS)
def test_every_exp_composes(exp):
    cfg = compose([f"+exp={exp}"])
    assert cfg.run.exp == exp
    assert cfg.model.num_layers > 0


def test_unknown_key_names_the_key():
    with pytest.raises(FtcoreError, match=r"parallel\.tpp"):
        compose(["+exp=tiny_full", "parallel.tpp=2"])


def test_wrong_type_names_the_key():
    with pytest.raises(FtcoreError, match=r"parallel\.tp"):
        compose(["+exp=tiny_full", "parallel.tp=two"])


def test_unknown_group_option_lists_options():
    with pytest.raises(FtcoreError, match="tiny"):
        compose(["+exp=tiny_full", "model=llama9"])


@pytest.mark.parametrize(
    "overrides, world, field",
    [
        (["parallel.tp=3"], 3, "parallel.tp"),  # 8 heads
        (
            ["model.num_query_groups=2", "model.num_attention_heads=8", "parallel.tp=4"],
            4,
            "parallel.tp",
        ),
        (["parallel.pp=3"], 3, "parallel.pp"),  # 4 layers: neither 4 nor 6 divides by 3... 6 does
        (["parallel.pp=5"], 5, "model.num_layers"),
        (["train.global_batch_size=10", "train.micro_batch_size=4"], 1, "train.global_batch_size"),
        (["train.global_batch_size=12", "train.micro_batch_size=4"], 2, "train.global_batch_size"),
        (["parallel.tp=2"], 3, "parallel.tp/parallel.pp/parallel.cp"),
        (["parallel.sp=true"], 1, "parallel.sp"),
        (["parallel.recompute=some"], 1, "parallel.recompute"),
        (["data.seq_len=2048"], 1, "data.seq_len"),  # tiny has 1024 positions
        (["parallel.cp=2", "data.seq_len=126"], 2, "data.seq_len"),  # 2*cp chunks
        (
            ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2", "data.seq_len=132"],
            4,
            "data.seq_len",
        ),
        (["parallel.cp=8", "parallel.cp_comm_type=a2a"], 8, "parallel.cp_comm_type"),  # 4 kv heads
        (["parallel.cp=2", "parallel.cp_comm_type=ring"], 2, "parallel.cp_comm_type"),
        (["parallel.cp=3"], 3, "data.seq_len"),  # 128 tokens do not cut into 6 chunks
        (["parallel.cp=2", "eval.accuracy=true"], 2, "eval.accuracy"),
        # packed rows on GPU: one row per micro-batch (THD), under CP too
        (
            ["parallel.cp=2", "cluster=h100", "train.micro_batch_size=2"],
            2,
            "train.micro_batch_size",
        ),
        (["parallel.cp=2", "parallel.cp_comm_type=a2a+p2p"], 2, "parallel.hierarchical_cp_sizes"),
        (
            [
                "parallel.cp=4",
                "parallel.cp_comm_type=a2a+p2p",
                "parallel.hierarchical_cp_sizes=[2,3]",
            ],
            4,
            "parallel.hierarchical_cp_sizes",  # 2 x 3 is not cp
        ),
        (
            ["parallel.cp=2", "parallel.hierarchical_cp_sizes=[1,2]"],
            2,
            "parallel.hierarchical_cp_sizes",
        ),
        (
            [
                "parallel.cp=8",
                "parallel.cp_comm_type=a2a+p2p",
                "parallel.hierarchical_cp_sizes=[8,1]",
            ],
            8,
            "parallel.cp_comm_type",  # the all-to-all over 8 ranks: tiny has 4 kv heads
        ),
    ],
)
def test_validation_names_the_field(overrides, world, field):
    cfg = compose(["+exp=tiny_full", *overrides])
    if overrides == ["parallel.pp=3"]:
        validate(cfg, world)  # 4 layers + embedding + loss = 6: megatron's uneven split works
        return
    with pytest.raises(FtcoreError) as e:
        validate(cfg, world)
    assert field in str(e.value)


def test_context_parallel_layouts_validate():
    """cp=2 with packed rows on CPU and on GPU (TE's THD split), and a2a where the KV heads
    divide by cp."""
    assert validate(compose(["+exp=tiny_full", "parallel.cp=2"]), 2) == 1
    gpu = [
        "+exp=tiny_full",
        "parallel.cp=2",
        "cluster=h100",
        "train.micro_batch_size=1",
        "cluster.num_gpus=2",
    ]
    assert validate(compose([*gpu, "data.packing=true"]), 2) == 1
    a2a = ["+exp=tiny_full", "parallel.cp=4", "parallel.cp_comm_type=a2a"]
    assert validate(compose(a2a), 8) == 2
    hier = ["parallel.cp_comm_type=a2a+p2p", "parallel.hierarchical_cp_sizes=[2,2]"]
    cfg = compose(["+exp=tiny_full", "parallel.cp=4", *hier])
    assert validate(cfg, 4) == 1
    from ftcore.models.llama import transformer_config  # megatron's own config takes the sizes

    assert transformer_config(cfg, on_cpu=True).hierarchical_context_parallel_sizes == [2, 2]


def test_generation_refuses_context_parallelism():
    from ftcore.validation.checks import check_generation

    check_generation(compose(["+exp=tiny_full"]))
    with pytest.raises(FtcoreError, match=r"parallel\.cp"):
        check_generation(compose(["+exp=tiny_full", "parallel.cp=2"]))


def test_decoding_is_refused_under_the_interleaved_schedule():
    """megatron's interleaved schedule refuses one micro-batch per forward (exit 1 at step 0
    before): ftcore.generate and an explicit eval.accuracy are refused naming vp; a preset's
    accuracy is skipped with a note instead."""
    from ftcore.config.presets import adapt
    from ftcore.validation.checks import check_accuracy_decodes, check_generation

    vp = ["+exp=tiny_lora", "parallel.pp=2", "parallel.vp=2"]
    check_generation(compose(["+exp=tiny_lora", "parallel.pp=2"]))
    with pytest.raises(FtcoreError, match=r"parallel\.vp: .*interleaved") as e:
        check_generation(compose(vp))
    assert "parallel.vp=1" in e.value.fix
    explicit = compose([*vp, "eval.accuracy=true"])
    adapt(explicit, training=True, say=False)
    with pytest.raises(FtcoreError, match=r"eval\.accuracy: .*interleaved"):
        check_accuracy_decodes(explicit)
    preset = compose(vp)
    assert preset.eval.accuracy
    adapt(preset, training=True, say=False)
    assert not preset.eval.accuracy
    check_accuracy_decodes(preset)


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "ftcore.train", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "args, field",
    [
        (["+exp=tiny_full", "parallel.tpp=2"], "parallel.tpp"),
        (["+exp=tiny_full", "parallel.tp=x"], "parallel.tp"),
        (["+exp=tiny_full", "parallel.tp=3"], "parallel.tp"),
        (["+exp=tiny_full", "train.global_batch_size=10"], "train.global_batch_size"),
        (["+exp=tiny_full", "data.seq_len=2048"], "data.seq_len"),  # tiny: 1024 positions
        (["+exp=nope"], "exp/nope"),
    ],
)
def test_cli_exits_2_with_one_line(args, field):
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("ftcore error")]
    assert len(lines) == 1 and field in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_cfg_job_prints_config():
    r = _run("+exp=tiny_full", "--cfg", "job")
    assert r.returncode == 0
    assert "tiny_full" in r.stdout and "parallel:" in r.stdout
