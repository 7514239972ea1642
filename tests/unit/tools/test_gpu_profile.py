"""tools/gpu_profile.py's GPU busy share: kernel time counted once, from torch's own event types.

The trace is built from torch.autograd's FunctionEvent (what the profiler produces under CUDA): one
host op (aten::mm) that launched one 300 us kernel, and the kernel itself on the device. The op
carries its kernel's time as its own device time, so summing every event gives 600 us."""

from __future__ import annotations

import sys
from pathlib import Path

from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import gpu_profile  # noqa: E402


def _trace() -> EventList:
    op = FunctionEvent(id=1, name="aten::mm", thread=0, start_us=0, end_us=40, use_device="cuda",
                       stack=[])  # fmt: skip
    op.append_kernel("nvjet_gemm", 0, 300)
    kernel = FunctionEvent(id=2, name="nvjet_gemm", thread=7, start_us=50, end_us=350,
                           use_device="cuda", device_type=DeviceType.CUDA, stack=[])  # fmt: skip
    trace = EventList([op, kernel], use_device="cuda")
    trace._build_tree()  # what the profiler does on exit
    return trace


def test_kernel_time_is_counted_once():
    events = _trace().key_averages()
    assert sum(e.self_device_time_total for e in events) == 600  # the double count
    assert gpu_profile.kernel_seconds(events) == 300e-6
