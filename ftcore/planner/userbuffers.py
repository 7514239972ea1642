"""GPU memory of Transformer Engine's userbuffers (parallel.tp_comm_overlap), read from TE 2.9's
transformer_engine/pytorch/module/base.py `initialize_ub` and common/comm_gemm_overlap/
comm_gemm_overlap.cpp (ftcore/runtime/userbuffers.py calls it; the same shape and modes, checked
against it by tests/unit/planner/test_userbuffers.py).

`initialize_ub` registers, for each quantization mode (FP8 under any FP8/FP4 recipe, plain BF16
without one, both where first_last_bf16_layers keeps BF16 layers in the run), one communicator
per GEMM of a TE transformer layer: 12 of them (ring_exchange: qkv_fprop, fc1_fprop, proj_dgrad,
fc2_dgrad; pipeline: proj_fprop, fc2_fprop; bulk: qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad;
external: proj_wgrad, fc2_wgrad). Each allocates a buffer of the full, TP-gathered layer input
[seq_len x micro_batch / cp, hidden] (`CommOverlapBase::initialize`, `CommOverlapP2PBase::
initialize`: none of the ring-exchange defaults is a reduce-scatter, which alone would take
(2tp - 1)/tp of it), in uint8 for the eight all-gather GEMMs under the FP8 mode (`fp8_buf`), in
the run's dtype otherwise. Beside them the cuBLAS workspace is repeated for its 3 streams (32 MiB
each on Hopper and Blackwell). Allocated once per process, on every pipeline stage, for the whole
run: 12 x 4096 x 8192 x 2 B = 0.75 GiB for a BF16 70B at seq 4096, 12 GiB at 131072 tokens and
cp=2.
"""

from __future__ import annotations

GEMMS = 12  # communicators per quantization mode
FP8_BUFFERS = 8  # of them, the all-gather ones, uint8 under the FP8 mode
STREAMS = 3  # TE's _NUM_MAX_UB_STREAMS: the cuBLAS workspace repeated per stream
CUBLAS_WORKSPACE = 32 * 1024 * 1024 + 1024  # get_cublas_workspace_size_bytes, compute >= 9.0


def active(cfg) -> bool:
    """TE's userbuffers are allocated: parallel.tp_comm_overlap at tp > 1 with TE layers on GPU."""
    p = cfg.parallel
    te = cfg.precision.te_layers and cfg.peft.name != "qlora"
    return (
        bool(getattr(p, "tp_comm_overlap", False))
        and p.tp > 1
        and te
        and cfg.cluster.device != "cpu"
    )


def modes(cfg) -> list[str]:
    """TE's UserBufferQuantizationMode names ftcore registers (runtime/userbuffers.py)."""
    pr = cfg.precision
    if not (pr.fp8_recipe or pr.fp4_recipe):
        return ["NONE"]
    return ["FP8", "NONE"] if pr.first_last_bf16_layers > 0 else ["FP8"]


def buffer_bytes(cfg) -> int:
    """Bytes the userbuffers take per GPU (0 when they are not allocated)."""
    if not active(cfg):
        return 0
    tokens = cfg.data.seq_len * cfg.train.micro_batch_size // cfg.parallel.cp
    one = tokens * cfg.model.hidden_size
    dtype = 2 if cfg.precision.params_dtype == "bf16" else 4
    total = STREAMS * CUBLAS_WORKSPACE
    for mode in modes(cfg):
        uint8 = FP8_BUFFERS if mode == "FP8" else 0
        total += one * (uint8 * 1 + (GEMMS - uint8) * dtype)
    return total
