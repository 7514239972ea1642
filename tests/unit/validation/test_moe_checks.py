"""MoE layouts that cannot work are refused before anything is built: exit 2, the field, the fix
(ftcore/validation/moe_checks.py, docs/moe.md)."""

from __future__ import annotations

import pytest

from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.validation.checks import check_layout

MOE = ["model.family=qwen3_moe", "model.num_experts=4", "model.moe_ffn_hidden_size=48",
       "model.moe_dense_layers=[1]", "model.num_layers=4", "model.hidden_size=64",
       "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=96",
       "train.global_batch_size=8", "train.micro_batch_size=1", "data.seq_len=32"]  # fmt: skip


@pytest.mark.parametrize(
    "over,world,training,field,needle",
    [
        (["parallel.ep=3"], 3, False, "parallel.ep", "does not divide num_experts=4"),
        (["parallel.ep=2", "parallel.pp=2"], 2, False, "parallel.ep", "ep*etp*pp = 2*1*2"),
        (["parallel.etp=2", "parallel.tp=2"], 2, False, "parallel.etp", "gloo"),
        (["parallel.tp=2", "parallel.ep=2"], 2, True, "parallel.sp", "sequence parallelism"),
        (["model.moe_router_topk=5"], 1, False, "model.moe_router_topk", "> num_experts=4"),
        (["model.moe_dense_layers=[7]"], 1, False, "model.moe_dense_layers", "[7]"),
        (["model.family=mixtral"], 1, False, "model.moe_dense_layers", "Mixtral has no dense"),
        (["model.family=mixtral", "model.moe_dense_layers=[]", "model.moe_norm_topk_prob=false"],
         1, False, "model.moe_norm_topk_prob", "renormalises"),
        (["model.family=llama"], 1, False, "model.num_experts", "has no experts"),
        (["model.num_experts=null", "model.family=llama", "parallel.ep=2"], 2, False,
         "parallel.ep", "is dense"),
        (["model.num_experts=null"], 1, False, "model.num_experts", "is not set"),
        (["moe.dispatcher=flex"], 1, False, "moe.dispatcher", "all-to-all"),
    ],
)  # fmt: skip
def test_refused_with_field_and_fix(over, world, training, field, needle):
    cfg = compose(MOE + over)
    with pytest.raises(FtcoreError) as e:
        check_layout(cfg, world, training=training)
    assert e.value.field == field and needle in str(e.value) and "fix" in str(e.value)


def test_layouts_that_work_pass():
    for over, world in ((["parallel.ep=2"], 2), (["parallel.ep=2", "parallel.tp=2"], 4),
                        (["parallel.ep=2", "parallel.pp=2"], 4), (["parallel.ep=4"], 4)):  # fmt: skip
        check_layout(compose(MOE + over), world, training=False)
    check_layout(compose(MOE + ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true"]), 4,
                 training=False)  # fmt: skip


def test_eval_exits_2_before_building(tmp_path, capsys):
    """From the entry point: exit 2, the one line, nothing written in run.dir."""
    from ftcore.cli import main
    from ftcore.eval import task

    run = tmp_path / "run"
    status = main("eval", task, MOE + ["parallel.ep=3", f"run.dir={run}", "launcher.nproc_per_node=1",
                                       "model.allow_random_base=true"])  # fmt: skip
    assert status == 2 and not run.exists()
    assert "ftcore error: parallel.ep: parallel.ep=3 does not divide" in capsys.readouterr().err


def test_a_gpu_recipe_on_ones_own_small_checkpoint_says_what_to_change(tmp_path, capsys):
    """Issue 52, item 6: `+exp=qwen3_30b_a3b_lora model.hf_path=<a small Qwen3-MoE>` on CPU is
    refused one setting at a time; each error names the checkpoint (not the preset's model, and
    no unrelated model to switch to), and parallel.ep=2 on one process names the launcher's fix."""
    from ftcore.cli import main
    from ftcore.train import task
    from tests.support.moe import make_tiny_moe

    hf = make_tiny_moe(tmp_path / "my-moe")
    base = [
        "+exp=qwen3_30b_a3b_lora",
        f"model.hf_path={hf}",
        "cluster=local_cpu",
        f"run.dir={tmp_path / 'run'}",
    ]

    def error(*over: str) -> str:
        assert main("train", task, [*base, *over]) == 2
        (line,) = [
            ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("ftcore error:")
        ]
        return line

    seq = error()
    assert seq.startswith(
        f"ftcore error: data.seq_len: seq_len=4096 is beyond the 256 positions of the checkpoint {hf}"
    )
    assert "qwen3_30b_a3b" not in seq and "llama31_70b" not in seq and "data.seq_len=256" in seq
    gpus = error("data.seq_len=256", "parallel.ep=2")
    assert "cluster.num_gpus=8" in gpus and "cluster.num_gpus=null" in gpus
    ep = error("data.seq_len=256", "parallel.ep=2", "cluster.num_gpus=null")
    assert ep.startswith("ftcore error: parallel.ep:") and "launcher.nproc_per_node=2" in ep
    assert not (tmp_path / "run").exists()
