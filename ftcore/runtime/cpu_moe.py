"""megatron-core's MoE layer on the CPU runtime (ftcore/runtime/cpu.py calls `install()` from
`activate()`; docs/cpu_runtime.md, docs/moe.md).

Two things in megatron-core 0.16.1 assume Transformer Engine or CUDA, fixed here without editing
megatron:
- `moe_utils.router_gating_linear` tests `te_general_gemm is not None`, a name bound only when
  TE imports: without TE it is a NameError. It is bound to None, megatron's own "no TE" value.
- `track_moe_metrics` creates its per-layer tracker with `device="cuda"`: it runs inside the
  device mode, which sends that to the CPU.
(The dispatcher's device-to-host event is the stream stand-in's `record_event`, in cpu.py.)
"""

from __future__ import annotations

import functools


def install() -> None:
    """Idempotent; a no-op where megatron's MoE modules are missing."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # pragma: no cover - megatron without MoE
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    track = moe_utils.track_moe_metrics
    if getattr(track, "ftcore_cpu", False):
        return

    @functools.wraps(track)
    def on_cpu(*args, **kwargs):
        from ftcore.runtime.cpu import device_mode

        with device_mode():
            return track(*args, **kwargs)

    on_cpu.ftcore_cpu = True
    moe_utils.track_moe_metrics = on_cpu
