"""The CPU runtime's lone-collective skip: over a group of one process, synchronous all-reduces and
broadcasts must not reach gloo (each costs 50-100 us there and leaves the tensor as it was), while
asynchronous ones still do, because their callers wait on the handle."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


def _c10d_calls(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("c10d::")]


def test_lone_collectives_skip_gloo_but_keep_async_handles(tmp_path):
    from ftcore.runtime import cpu

    cpu.activate()
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
        )
    try:
        t = torch.arange(6.0)
        assert _c10d_calls(lambda: dist.all_reduce(t)) == []
        assert _c10d_calls(lambda: dist.broadcast(t, src=0)) == []
        torch.testing.assert_close(t, torch.arange(6.0))

        handles = []
        calls = _c10d_calls(lambda: handles.append(dist.all_reduce(t, async_op=True)))
        assert any("allreduce" in c for c in calls), calls
        handles[0].wait()
        calls = _c10d_calls(lambda: handles.append(dist.broadcast(t, src=0, async_op=True)))
        assert any("broadcast" in c for c in calls), calls
        handles[1].wait()
        torch.testing.assert_close(t, torch.arange(6.0))
    finally:
        if owned:
            dist.destroy_process_group()
