"""The speed options (parallel.overlap_*, parallel.tp_comm_overlap, parallel.recompute*, perf.*)
as megatron's TransformerConfig and DistributedDataParallelConfig fields, and their checks.

One place decides what each key means on CPU and on GPU, so the build (models/llama.py,
models/builder.py), the checks run before anything is built (validation/checks.py) and the planner
read the same thing. GPU-only options are validated on any machine by constructing megatron's
real config objects from them (`check`); only a run on the GPU itself needs Transformer Engine
(`check_device`). docs/gpu_speed.md says what each option buys.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from ftcore.errors import FtcoreError

RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
CUDA_GRAPHS = ("none",)  # transformer_engine is refused: nothing in ftcore captures graphs
GRAD_REDUCE_DTYPES = ("fp32", "bf16")


def grad_reduce_in_fp32(cfg: DictConfig) -> bool:
    """Grad buffers (and the DP reduction) in fp32; bf16 halves them (2 bytes per trainable param)."""
    return cfg.perf.grad_reduce_dtype == "fp32"


def fixed_shapes(cfg: DictConfig) -> bool:
    """Every micro-batch has the same [tokens, hidden] shape: packed rows (seq_len tokens each) or
    unpacked rows padded to seq_len (trim_padding off). TE userbuffers need it."""
    return bool(cfg.data.packing or not cfg.data.trim_padding)


def transformer_kwargs(cfg: DictConfig, *, on_cpu: bool) -> dict[str, Any]:
    """TransformerConfig fields of the speed options. On CPU only what the CPU path has: pipeline
    send/recv overlap, recompute, ftcore's SwiGLU; the GPU-only options stay off there."""
    from ftcore.models.local import swiglu
    from ftcore.precision import recipes

    p, f = cfg.parallel, cfg.perf
    # only the interleaved schedule overlaps its sends: elsewhere the flag is a no-op (as in
    # Megatron-Bridge), so a layout change to pp=1 or vp=1 needs no second override
    overlap_p2p = bool(p.overlap_p2p_comm and p.pp > 1 and p.vp > 1)
    kw: dict[str, Any] = dict(
        overlap_p2p_comm=overlap_p2p,
        # megatron forbids both; on CPU gloo matches batched isend/irecv between the same two
        # ranks out of order, so the CPU path never batches (runtime/cpu.py orders open sends)
        batch_p2p_comm=not on_cpu and not overlap_p2p,
        tp_comm_overlap=bool(p.tp_comm_overlap and p.tp > 1 and not on_cpu),
        bias_activation_fusion=bool(
            f.bias_activation_fusion and (swiglu.use_cpu_swiglu() if on_cpu else True)
        ),
        # TE's layers accumulate wgrads into main_grad themselves, but megatron's own output layer
        # (ColumnParallelLinear) refuses the flag without apex's kernel: on only with both
        gradient_accumulation_fusion=bool(
            f.gradient_accumulation_fusion
            and not on_cpu
            and recipes.use_te(cfg)
            and wgrad_kernel_present()
        ),
    )
    if p.recompute == "selective":
        kw.update(recompute_granularity="selective", recompute_modules=list(p.recompute_modules))
    elif p.recompute == "full":
        kw.update(
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=p.recompute_num_layers,
        )
    return kw


def wgrad_kernel_present() -> bool:
    """apex's fused_weight_gradient_mlp_cuda (NVIDIA's PyTorch images ship it), which megatron's
    non-TE linears need for gradient-accumulation fusion (as Megatron-Bridge checks it)."""
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def ddp_config_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """DistributedDataParallelConfig fields. align_param_gather: with interleaving the schedule
    starts each chunk's gather itself (trainer wires param_sync_func), as megatron's training does."""
    p = cfg.parallel
    gather = bool(p.overlap_param_gather and p.distributed_optimizer)
    return dict(
        grad_reduce_in_fp32=grad_reduce_in_fp32(cfg),
        overlap_grad_reduce=bool(p.overlap_grad_reduce),
        overlap_param_gather=gather,
        align_param_gather=gather and p.pp > 1 and p.vp > 1,
    )


def _refuse(msg: str, field: str, fix: str) -> None:
    raise FtcoreError(msg, field=field, fix=fix)


def _check_rules(cfg: DictConfig) -> None:
    """ftcore's own rules, each with its field and fix (before megatron's generic asserts)."""
    p, f = cfg.parallel, cfg.perf
    on_gpu = cfg.cluster.device != "cpu"
    if p.recompute == "selective":
        bad = [m for m in p.recompute_modules if m not in RECOMPUTE_MODULES]
        if bad or not p.recompute_modules:
            _refuse(f"recompute_modules {list(p.recompute_modules)} is not a non-empty list of "
                    f"{', '.join(RECOMPUTE_MODULES)}", "parallel.recompute_modules",
                    "e.g. parallel.recompute_modules=[core_attn,mlp]")  # fmt: skip
    if p.recompute_num_layers < 1:
        _refuse(f"must be >= 1, not {p.recompute_num_layers}", "parallel.recompute_num_layers",
                "parallel.recompute_num_layers=1 (recompute each layer from its input)")  # fmt: skip
    if p.overlap_param_gather and not p.distributed_optimizer:
        _refuse("overlap_param_gather overlaps the distributed optimizer's parameter all-gather; "
                "without parallel.distributed_optimizer there is none", "parallel.overlap_param_gather",
                "set parallel.distributed_optimizer=true, or parallel.overlap_param_gather=false")  # fmt: skip
    if f.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        _refuse(f"{f.grad_reduce_dtype!r} is not one of {', '.join(GRAD_REDUCE_DTYPES)}",
                "perf.grad_reduce_dtype", "perf.grad_reduce_dtype=fp32")  # fmt: skip
    if f.manual_gc_interval < 0:
        _refuse(f"must be >= 0, not {f.manual_gc_interval}", "perf.manual_gc_interval",
                "perf.manual_gc_interval=0 (one collection, at the start)")  # fmt: skip
    if f.cuda_graphs == "transformer_engine":  # issue 41, item 7: no option that does nothing
        _refuse("ftcore does not capture CUDA graphs: megatron's TECudaGraphHelper, which "
                "Megatron-LM's training loop creates and calls at its warm-up step, is not wired "
                "into ftcore's loop, so every layer would run eagerly", "perf.cuda_graphs",
                "perf.cuda_graphs=none")  # fmt: skip
    if f.cuda_graphs not in CUDA_GRAPHS:
        _refuse(f"{f.cuda_graphs!r} is not one of {', '.join(CUDA_GRAPHS)}", "perf.cuda_graphs",
                "perf.cuda_graphs=none")  # fmt: skip
    gpu_only = {
        "parallel.tp_comm_overlap": p.tp_comm_overlap and p.tp > 1,
        "perf.gradient_accumulation_fusion": f.gradient_accumulation_fusion,
    }
    for key, on in gpu_only.items():
        if on and not on_gpu:
            _refuse(f"{key} is a GPU option (Transformer Engine) but cluster.device=cpu", key,
                    f"leave {key} at its default on CPU; ftcore.plan prices it for a GPU cluster")  # fmt: skip
    if p.tp_comm_overlap and p.tp > 1:  # tp=1: no TP traffic, a no-op (layout search, tp=1 runs)
        if not p.sp:
            _refuse(f"TE userbuffers overlap the sequence-parallel all-gathers and reduce-scatters "
                    f"of tensor parallelism (tp={p.tp}, sp={p.sp})", "parallel.tp_comm_overlap",
                    "set parallel.tp>1 and parallel.sp=true, or parallel.tp_comm_overlap=false")  # fmt: skip
        if not fixed_shapes(cfg):
            _refuse("TE userbuffers are allocated once for [seq_len x micro_batch_size, hidden]; "
                    "unpacked rows trimmed per micro-batch change that shape",
                    "parallel.tp_comm_overlap",
                    "set data.packing=true or data.trim_padding=false")  # fmt: skip
        if cfg.peft.name == "qlora" or not cfg.precision.te_layers:
            _refuse("TE userbuffers need Transformer Engine's layers (QLoRA and "
                    "precision.te_layers=false build megatron's local ones)",
                    "parallel.tp_comm_overlap", "parallel.tp_comm_overlap=false")  # fmt: skip
        from ftcore.runtime import userbuffers

        why = userbuffers.problem(cfg)
        if why:
            _refuse(why, "parallel.tp_comm_overlap",
                    "parallel.tp_comm_overlap=false with this precision (or precision=fp8_cs)")  # fmt: skip


def check(cfg: DictConfig) -> None:
    """ftcore's rules, then megatron's own: its TransformerConfig and DistributedDataParallelConfig
    constructed from the job's shapes and the GPU-side speed fields (no module is built, no TE
    needed). A combination megatron refuses is a FtcoreError (exit 2) before anything runs."""
    _check_rules(cfg)
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    m, p = cfg.model, cfg.parallel
    on_cpu = cfg.cluster.device == "cpu"
    dtype = torch.bfloat16 if cfg.precision.params_dtype == "bf16" else torch.float32
    kw = transformer_kwargs(cfg, on_cpu=on_cpu)
    kw["gradient_accumulation_fusion"] = False  # megatron checks it by importing the kernels
    if cfg.precision.fp8_recipe == "delayed":  # megatron's FP8 x recompute rules (the other
        from ftcore.precision import recipes  # recipes' rules ask TE's version: on target)

        kw.update(fp8=recipes.fp8_format(cfg), fp8_recipe="delayed")
    try:
        TransformerConfig(
            num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
            num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=_silu(),
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp,
            virtual_pipeline_model_parallel_size=p.vp if p.vp > 1 else None,
            sequence_parallel=p.sp, params_dtype=dtype, pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16, **kw,
        )  # fmt: skip
        DistributedDataParallelConfig(
            use_distributed_optimizer=p.distributed_optimizer, **ddp_config_kwargs(cfg)
        )
    except (ValueError, AssertionError, TypeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FtcoreError(f"megatron-core refuses this combination: {msg}", field="parallel",
                          fix="see docs/gpu_speed.md for what each option needs") from e  # fmt: skip


def _silu():
    import torch.nn.functional as F

    return F.silu


def check_device(cfg: DictConfig, te_version) -> None:
    """On the GPU that runs the job: the TE-only options need Transformer Engine present."""
    if cfg.cluster.device == "cpu" or te_version is not None:
        return
    p = cfg.parallel
    for key, on in {
        "parallel.tp_comm_overlap": p.tp_comm_overlap and p.tp > 1,
    }.items():
        if on:
            _refuse(f"{key} needs Transformer Engine, which is not installed or cannot load here",
                    key, f"install transformer-engine (ftcore's container has it) or set {key} off")  # fmt: skip
