"""Decode shapes: what a generation or evaluation run must not inherit from a training experiment.

`ftcore.generate` and exact-match accuracy feed one new token per row at each KV-cache step (and a
prompt of any length first). Two training settings cannot run at those shapes under Transformer
Engine (rules read from TE 2.9's source):
- FP8/FP4 GEMMs: `transformer_engine/pytorch/utils.py assert_dim_for_fp8_exec` wants the tokens of
  an FP8 GEMM to be a multiple of 8; the block-scaled quantizers' `is_quantizable`
  (`tensor/mxfp8_tensor.py`, `nvfp4_tensor.py`, `float8_blockwise_tensor.py`) multiples of their
  block, 32, 16 and 128. A decode step of a few rows has a few tokens;
- userbuffers (`parallel.tp_comm_overlap`): allocated once for the training shape
  [seq_len x micro_batch_size / cp, hidden] (runtime/userbuffers.py).
(CUDA graphs, which would replay the training shapes, are refused everywhere: models/speed.py.)
`decode_safe` derives the config that runs instead (BF16 compute, no userbuffers), saying
what it changed; the trainer's own accuracy, which decodes with the training model, is refused
where the training config has any of them (validation/checks.py).
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

log = logging.getLogger("ftcore")

# Tokens per GEMM each recipe needs (TE 2.9, files above).
TOKEN_MULTIPLE = {"delayed": 8, "tensorwise": 8, "blockwise": 128, "mxfp8": 32, "nvfp4": 16}


def decode_problems(cfg: DictConfig) -> list[tuple[str, str]]:
    """(key, why) for each setting of cfg that TE cannot run at decode shapes."""
    p = cfg.precision
    out = []
    recipe = p.fp8_recipe or p.fp4_recipe
    if recipe:
        out.append(("precision", f"{p.name}: TE's {recipe} GEMMs need a multiple of "
                    f"{TOKEN_MULTIPLE.get(recipe, 8)} tokens, a decode step has one per row"))  # fmt: skip
    if cfg.parallel.tp_comm_overlap and cfg.parallel.tp > 1:
        out.append(("parallel.tp_comm_overlap", "TE userbuffers hold the training shape only"))
    return out


def decode_safe(cfg: DictConfig, *, say: bool = True) -> list[str]:
    """Make cfg (in place) one that decodes: BF16 (or the experiment's fp32) compute instead of
    FP8/FP4, no userbuffers. The weights are the same: FP8/FP4 training keeps
    high-precision masters, and a checkpoint or HF directory loads into BF16 layers. Returns the
    changes (logged when `say`)."""
    changes = []
    p = cfg.precision
    if p.fp8_recipe or p.fp4_recipe:
        was = p.name
        p.fp8_recipe = p.fp4_recipe = None
        p.fp8_param_gather = p.fp8_attention = False
        p.first_last_bf16_layers = 0
        p.name = p.params_dtype
        changes.append(f"precision {was} -> {p.name}")
    if cfg.parallel.tp_comm_overlap:
        cfg.parallel.tp_comm_overlap = False
        changes.append("parallel.tp_comm_overlap true -> false")
    if changes and say:
        log.info("decoding runs a decode-safe copy of the config (Transformer Engine cannot run "
                 "these at one token per row): %s", "; ".join(changes))  # fmt: skip
    return changes
