"""megatron-core's MoE layer on the CPU runtime (ftcore/runtime/cpu.py calls `install` from
`activate()`; docs/cpu_runtime.md, docs/moe.md).

Three things in megatron-core 0.16.1 assume Transformer Engine or CUDA, fixed here without editing
megatron:
- `moe_utils.router_gating_linear` tests `te_general_gemm is not None`, a name bound only when
  TE imports: without TE it is a NameError. It is bound to None, megatron's own "no TE" value.
- the all-to-all dispatcher moves its split sizes to the host as numpy arrays with
  `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts CUDA tensors only: on the CPU
  they stayed tensors, which gloo's `all_to_all_single` does not take as split sizes. The
  dispatcher's copy converts CPU tensors too.
- `track_moe_metrics` creates its per-layer tracker with `device="cuda"`: it runs inside the
  device mode, which sends that to the CPU.
(The dispatcher's device-to-host event is the stream stand-in's `record_event`, in cpu.py.)
"""

from __future__ import annotations

import functools

import torch


def install(device_mode) -> None:
    """Idempotent; a no-op where megatron's MoE modules are missing. `device_mode`: cpu.py's
    rewriting mode (passed in: cpu.py imports this module)."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # pragma: no cover - megatron without MoE
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.transformer.moe import token_dispatcher

    move = moe_utils.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    track = moe_utils.track_moe_metrics
    if getattr(track, "ftcore_cpu", False):
        return

    @functools.wraps(track)
    def on_cpu(*args, **kwargs):
        with device_mode():
            return track(*args, **kwargs)

    on_cpu.ftcore_cpu = True
    moe_utils.track_moe_metrics = on_cpu
