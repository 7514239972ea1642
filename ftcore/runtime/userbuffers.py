"""Transformer Engine userbuffers for parallel.tp_comm_overlap (docs/gpu_speed.md).

TE splits each TP/SP all-gather and reduce-scatter into chunks that run on their own SMs while the
GEMM they feed computes the previous chunk. The buffers are allocated once, before the model is
built, for the [tokens, hidden] input of a layer: tokens = seq_len x micro_batch_size / cp, the
same every micro-batch (models/speed.py refuses trimmed, variable-length micro-batches). GPU only.

Which communicators, read from TE 2.9's transformer_engine/pytorch/module/base.py:
- a layer looks its communicator up by (name, FP8 autocast on or off) (`get_ub`), and TE's FP8
  autocast state is on under any quantized recipe, NVFP4 included: FP8-mode communicators for
  every FP8/FP4 recipe, plain ones without, and both where `first_last_bf16_layers` leaves layers
  in BF16 inside the run (as Megatron-LM's initialize.py registers them);
- the all-gather into a userbuffer (`fill_userbuffers_buffer_for_all_gather`) takes unquantized
  inputs and FP8 delayed/current-scaling and MXFP8 quantizers only (MXFP8 with a multiple of 128
  tokens per rank); NVFP4 and FP8-blockwise quantizers raise "Unsupported quantizer".

How `initialize_ub` bootstraps (the same file): without `bootstrap_backend` it picks MPI whenever
torch was built with MPI (NGC's is), then gloo, then NCCL, and creates a process group of that
backend over the world; processes started by torchrun or ftcore.launch.node are no MPI job, so that
group cannot form. Megatron-LM always passes its `tp_comm_bootstrap_backend` (default "nccl",
megatron/core/model_parallel_config.py; megatron/training/initialize.py `_initialize_tp_communicators`):
ftcore passes "nccl" too. And it asserts CUDA multicast support unless `UB_SKIPMC=1` (then CUDA IPC
is used, as its C++ userbuffers code also decides by itself): ftcore sets UB_SKIPMC=1 where the
device has no multicast, unless the user set it.
"""

from __future__ import annotations

import logging
import os

from omegaconf import DictConfig

log = logging.getLogger("ftcore")

# Recipes whose input quantizer TE 2.9's userbuffer all-gather accepts (see above).
ALL_GATHER_RECIPES = ("delayed", "tensorwise", "mxfp8")
MXFP8_TOKENS = 128  # MXFP8 scale-inverses are gathered per 128 rows
BOOTSTRAP_BACKEND = "nccl"  # Megatron-LM's tp_comm_bootstrap_backend default

_initialized = False


def buffer_shape(cfg: DictConfig) -> list[int]:
    """[sequence x batch, hidden] of one layer's full (TP-gathered) input."""
    tokens = cfg.data.seq_len * cfg.train.micro_batch_size // cfg.parallel.cp
    return [tokens, cfg.model.hidden_size]


def quantization_modes(cfg: DictConfig) -> list[str]:
    """TE's UserBufferQuantizationMode names to register: FP8 under any FP8/FP4 recipe (and NONE
    too with BF16 first/last layers), NONE without one."""
    p = cfg.precision
    if not (p.fp8_recipe or p.fp4_recipe):
        return ["NONE"]
    return ["FP8", "NONE"] if p.first_last_bf16_layers > 0 else ["FP8"]


def problem(cfg: DictConfig) -> str | None:
    """Why TE's userbuffers cannot run this precision, or None."""
    p = cfg.precision
    recipe = p.fp8_recipe or p.fp4_recipe
    if recipe and recipe not in ALL_GATHER_RECIPES:
        return (f"Transformer Engine's userbuffer all-gather takes no {recipe} quantizer "
                f"(precision={p.name}); it takes bf16, FP8 delayed or current scaling, and MXFP8")  # fmt: skip
    if recipe == "mxfp8":
        tokens = buffer_shape(cfg)[0] // cfg.parallel.tp
        if tokens % MXFP8_TOKENS:
            return (f"the MXFP8 userbuffer all-gather needs a multiple of {MXFP8_TOKENS} tokens "
                    f"per TP rank; seq_len x micro_batch_size / (cp x tp) = {tokens}")  # fmt: skip
    return None


def initialize(cfg: DictConfig) -> bool:
    """Allocate TE's userbuffer communicators once per process (after the process group and
    megatron's parallel state, before the model). False when the option is off or on CPU."""
    global _initialized
    p = cfg.parallel
    if not p.tp_comm_overlap or p.tp < 2 or cfg.cluster.device == "cpu" or _initialized:
        return _initialized
    import inspect

    import torch
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.module import base

    kw = dict(
        shape=buffer_shape(cfg),
        tp_size=p.tp,
        dtype=torch.bfloat16 if cfg.precision.params_dtype == "bf16" else torch.float32,
    )
    modes = quantization_modes(cfg)
    if hasattr(base, "UserBufferQuantizationMode"):  # TE >= 2.7
        kw["quantization_modes"] = [getattr(base.UserBufferQuantizationMode, m) for m in modes]
    else:
        kw["use_fp8"] = "FP8" in modes
    if "bootstrap_backend" in inspect.signature(base.initialize_ub).parameters:
        kw["bootstrap_backend"] = BOOTSTRAP_BACKEND  # never TE's own pick, MPI (module doc)
    if not tex.device_supports_multicast() and "UB_SKIPMC" not in os.environ:
        os.environ["UB_SKIPMC"] = "1"  # CUDA IPC instead of multicast (module doc)
        log.info("userbuffers: this GPU has no CUDA multicast; UB_SKIPMC=1 (CUDA IPC)")
    base.initialize_ub(**kw)
    _initialized = True
    return True
