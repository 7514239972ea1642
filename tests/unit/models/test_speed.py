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


def te_userbuffers_stand_in(monkeypatch, *, multicast: bool) -> list:
    """Stand-ins for Transformer Engine's userbuffer start, with TE 2.9's own rules
    (transformer_engine/pytorch/module/base.py, `initialize_ub`): it asserts CUDA multicast unless
    UB_SKIPMC=1, and without `bootstrap_backend` picks MPI whenever torch has MPI, then gloo, then
    NCCL, for the process group it creates. Returns the bootstrap backends it was started with."""
    import enum
    import os
    import sys
    import types

    import torch

    started = []
    tex = types.ModuleType("transformer_engine_torch")
    tex.device_supports_multicast = lambda: multicast

    def initialize_ub(shape, tp_size, use_fp8=False, quantization_modes=None,
                      dtype=torch.bfloat16, ub_cfgs=None, bootstrap_backend=None):  # fmt: skip
        if not tex.device_supports_multicast():  # TE 2.9's assert
            assert bool(int(os.getenv("UB_SKIPMC", "0"))), "Launch app with UB_SKIPMC=1"
        if bootstrap_backend is None:  # TE 2.9's choice
            bootstrap_backend = "nccl"
            if torch.distributed.is_mpi_available():
                bootstrap_backend = "mpi"
            elif torch.distributed.is_gloo_available():
                bootstrap_backend = "gloo"
        started.append(bootstrap_backend)

    base = types.ModuleType("transformer_engine.pytorch.module.base")
    base.initialize_ub = initialize_ub
    base.UserBufferQuantizationMode = enum.Enum("UserBufferQuantizationMode", "FP8 NONE")
    names = (
        "transformer_engine",
        "transformer_engine.pytorch",
        "transformer_engine.pytorch.module",
    )
    parents = [types.ModuleType(n) for n in names]
    parents[0].pytorch, parents[1].module, parents[2].base = parents[1], parents[2], base
    for m in (*parents, base, tex):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    return started


@pytest.mark.parametrize("multicast", [True, False])
def test_userbuffers_bootstrap_over_nccl_and_without_multicast(monkeypatch, multicast):
    """Issue 50 item 6: ftcore called initialize_ub without bootstrap_backend, so TE picked MPI
    under NGC's torch (built with MPI) and made an MPI group that ranks started by torchrun or
    ftcore.launch.node cannot join; and TE asserted multicast unless UB_SKIPMC=1 was set. Megatron-
    LM passes its tp_comm_bootstrap_backend (nccl)."""
    import torch

    from ftcore.runtime import userbuffers

    started = te_userbuffers_stand_in(monkeypatch, multicast=multicast)
    monkeypatch.setattr(torch.distributed, "is_mpi_available", lambda: True)  # NGC's torch
    monkeypatch.delenv("UB_SKIPMC", raising=False)
    monkeypatch.setattr(userbuffers, "_initialized", False)
    assert userbuffers.initialize(compose([*GPU, "precision=bf16"]))
    assert started == ["nccl"]
    import os

    assert os.environ.get("UB_SKIPMC") == (None if multicast else "1")
