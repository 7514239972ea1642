"""Transformer Engine userbuffers for parallel.tp_comm_overlap (docs/gpu_speed.md).

TE splits each TP/SP all-gather and reduce-scatter into chunks that run on their own SMs while the
GEMM they feed computes the previous chunk. The buffers are allocated once, before the model is
built, for the [tokens, hidden] input of a layer: tokens = seq_len x micro_batch_size / cp, the
same every micro-batch (models/speed.py refuses trimmed, variable-length micro-batches). GPU only.
"""

from __future__ import annotations

from omegaconf import DictConfig

_initialized = False


def buffer_shape(cfg: DictConfig) -> list[int]:
    """[sequence x batch, hidden] of one layer's full (TP-gathered) input."""
    tokens = cfg.data.seq_len * cfg.train.micro_batch_size // cfg.parallel.cp
    return [tokens, cfg.model.hidden_size]


def initialize(cfg: DictConfig) -> bool:
    """Allocate TE's userbuffer communicators once per process (after the process group and
    megatron's parallel state, before the model). False when the option is off or on CPU."""
    global _initialized
    p = cfg.parallel
    if not p.tp_comm_overlap or p.tp < 2 or cfg.cluster.device == "cpu" or _initialized:
        return _initialized
    import torch
    from transformer_engine.pytorch.module.base import initialize_ub

    initialize_ub(
        shape=buffer_shape(cfg),
        tp_size=p.tp,
        use_fp8=bool(cfg.precision.fp8_recipe),  # all-gather buffers in FP8 under an FP8 recipe
        dtype=torch.bfloat16 if cfg.precision.params_dtype == "bf16" else torch.float32,
    )
    _initialized = True
    return True
