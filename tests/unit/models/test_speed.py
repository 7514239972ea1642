"""models/speed.py: every speed option reaches megatron's real configs as documented, and each
combination that cannot work is a FtcoreError naming its field (exit 2) before anything is built,
on this CPU machine, whether or not Transformer Engine is installed."""

from __future__ import annotations

import pytest

from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.models import speed

GPU = ["+exp=70b_fp8"]  # TP=2/SP, PP=4 x vp=20, packed rows, on an H100 cluster


def _refused(overrides: list[str]) -> FtcoreError:
    with pytest.raises(FtcoreError) as e:
        speed.check(compose(overrides))
    return e.value


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["parallel.sp=false"], "parallel.tp_comm_overlap"),  # userbuffers need SP
        (["data.packing=false", "data.trim_padding=true"], "parallel.tp_comm_overlap"),
        (["peft=qlora", "precision=bf16"], "parallel.tp_comm_overlap"),  # local layers, no TE
        (["parallel.distributed_optimizer=false", "parallel.overlap_param_gather=true"],
         "parallel.overlap_param_gather"),
        (["parallel.recompute=selective", "parallel.recompute_modules=[attention]"],
         "parallel.recompute_modules"),
        (["parallel.recompute=full", "parallel.recompute_num_layers=0"],
         "parallel.recompute_num_layers"),
        (["perf.grad_reduce_dtype=fp16"], "perf.grad_reduce_dtype"),
        (["perf.manual_gc_interval=-1"], "perf.manual_gc_interval"),
        (["perf.cuda_graphs=local"], "perf.cuda_graphs"),
        # issue 41, item 7: nothing in ftcore captures graphs, so the option is refused
        (["perf.cuda_graphs=transformer_engine"], "perf.cuda_graphs"),
        # issue 41, item 4: TE 2.9's userbuffer all-gather takes no NVFP4 or blockwise quantizer,
        # and MXFP8 only with a multiple of 128 tokens per TP rank (4160 / tp=2 = 2080)
        (["precision=nvfp4"], "parallel.tp_comm_overlap"),
        (["precision=fp8_blockwise"], "parallel.tp_comm_overlap"),
        (["precision=mxfp8", "data.seq_len=4160"], "parallel.tp_comm_overlap"),
        # megatron-core's own rule (TransformerConfig), reached through its real constructor
        (["precision=fp8_delayed", "parallel.recompute=selective",
          "parallel.recompute_modules=[layernorm]"], "parallel"),
    ],
)  # fmt: skip
def test_a_combination_that_cannot_work_is_refused(overrides, field):
    assert _refused(GPU + overrides).field == field


@pytest.mark.parametrize(
    "key", ["parallel.tp_comm_overlap=true", "perf.gradient_accumulation_fusion=true",
            "perf.cuda_graphs=transformer_engine"],
)  # fmt: skip
def test_gpu_only_options_are_refused_on_a_cpu_cluster(key):
    cpu = ["+exp=tiny_full", "parallel.tp=2", "parallel.sp=true"]
    assert _refused([*cpu, key]).field == key.split("=")[0]


def test_the_shipped_gpu_recipes_pass_megatrons_own_checks():
    """Every GPU exp as shipped constructs megatron's configs."""
    for exp in ("70b_fp8", "70b_lora", "70b_full", "405b_full", "405b_lora", "405b_nvfp4_lora",
                "8b_lora"):  # fmt: skip
        speed.check(compose([f"+exp={exp}"]))
    speed.check(compose([*GPU, "precision=mxfp8"]))  # 2048 tokens per TP rank: userbuffers take it


def autocast_states(cfg) -> set[bool]:
    """TE 2.9's rule (module/base.py get_ub, transformer_engine/pytorch/quantization.py): a layer
    looks its userbuffer communicator up by its FP8 autocast state, which is on for every layer
    run under an FP8 or FP4 recipe and off for the BF16 first/last layers and BF16 runs."""
    p = cfg.precision
    if not (p.fp8_recipe or p.fp4_recipe):
        return {False}
    return {True, False} if p.first_last_bf16_layers > 0 else {True}


@pytest.mark.parametrize(
    "precision", [["precision=bf16"], ["precision=fp8_cs"], ["precision=mxfp8"],
                  ["precision=fp8_cs", "precision.first_last_bf16_layers=1"], ["precision=nvfp4"]],
)  # fmt: skip
def test_userbuffers_are_registered_for_every_autocast_state(precision):
    """Issue 41, item 4: ftcore registered use_fp8=bool(fp8_recipe): none in FP8 mode under NVFP4
    ("UB for proj_fprop with use_fp8=True is not registered"), and one mode only where BF16
    first/last layers need the other (Megatron-LM registers both)."""
    from ftcore.runtime import userbuffers

    cfg = compose([*GPU, *precision])
    registered = {m == "FP8" for m in userbuffers.quantization_modes(cfg)}
    assert autocast_states(cfg) <= registered, (precision, registered)


def test_gpu_fields_as_megatron_gets_them():
    cfg = compose(
        GPU + ["parallel.recompute=selective", "parallel.recompute_modules=[core_attn,mlp]"]
    )
    gpu = speed.transformer_kwargs(cfg, on_cpu=False)
    assert gpu["tp_comm_overlap"] and gpu["overlap_p2p_comm"] and not gpu["batch_p2p_comm"]
    assert gpu["bias_activation_fusion"]
    assert gpu["recompute_granularity"] == "selective"
    assert gpu["recompute_modules"] == ["core_attn", "mlp"]
    cpu = speed.transformer_kwargs(cfg, on_cpu=True)  # the CPU path keeps only what it has
    assert not cpu["tp_comm_overlap"] and not cpu["gradient_accumulation_fusion"]
    assert cpu["overlap_p2p_comm"] and not cpu["batch_p2p_comm"]
    off = speed.transformer_kwargs(compose(GPU + ["parallel.overlap_p2p_comm=false"]), on_cpu=False)
    assert off["batch_p2p_comm"] and not off["overlap_p2p_comm"]
    tp1 = compose(GPU + ["parallel.tp=1", "parallel.sp=false"])  # no TP traffic: a no-op
    speed.check(tp1)
    assert not speed.transformer_kwargs(tp1, on_cpu=False)["tp_comm_overlap"]
    for no_interleaving in (["parallel.vp=1"], ["parallel.pp=1", "parallel.vp=1"]):  # a no-op there
        flat = compose(GPU + no_interleaving)
        speed.check(flat)
        assert not speed.transformer_kwargs(flat, on_cpu=False)["overlap_p2p_comm"]
    full = speed.transformer_kwargs(
        compose(GPU + ["parallel.recompute=full", "parallel.recompute_num_layers=2"]), on_cpu=False
    )
    assert (full["recompute_method"], full["recompute_num_layers"]) == ("uniform", 2)


def test_ddp_fields():
    dp = ["+exp=70b_full", "cluster.num_gpus=16", "parallel.pp=2", "parallel.vp=2"]
    on = speed.ddp_config_kwargs(compose(dp + ["parallel.overlap_grad_reduce=true",
                                               "parallel.overlap_param_gather=true"]))  # fmt: skip
    assert on == dict(grad_reduce_in_fp32=False, overlap_grad_reduce=True,
                      overlap_param_gather=True, align_param_gather=True)  # fmt: skip
    fp32 = speed.ddp_config_kwargs(compose(dp + ["perf.grad_reduce_dtype=fp32"]))
    assert fp32["grad_reduce_in_fp32"] and not fp32["overlap_grad_reduce"]


def test_userbuffer_shape_and_te_on_the_target():
    from ftcore.runtime import userbuffers

    cfg = compose(GPU + ["train.micro_batch_size=2"])
    assert userbuffers.buffer_shape(cfg) == [4096 * 2, 8192]
    with pytest.raises(FtcoreError) as e:  # only the GPU that runs it needs TE
        speed.check_device(cfg, te_version=None)
    assert e.value.field == "parallel.tp_comm_overlap"
    speed.check_device(cfg, te_version="2.8.0")
    speed.check_device(compose(GPU + ["parallel.tp_comm_overlap=false"]), te_version=None)
