"""The CPU runtime's lone-collective skip: over a group of one process, synchronous all-reduces and
broadcasts must not reach gloo (each costs 50-100 us there and leaves the tensor as it was), while
asynchronous ones still do, because their callers wait on the handle. Its optimizer changes take
the step they replace: torch's fused AdamW kernel for the per-tensor loop, and a step without
torch's dynamo-importing wrapper for the wrapper's."""

from __future__ import annotations

from types import SimpleNamespace

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


def _adamw_steps(change=None, hook=None, **adamw):
    """Three AdamW steps over the same parameters and gradients; `change` (a cpu function) first
    applied to the optimizer as megatron holds it. Returns the parameters and the optimizer."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(33, 7)) for _ in range(3)]
    grads = [torch.randn_like(p) for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **adamw)
    if hook:
        opt.register_step_post_hook(hook)
    if change:
        change(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=opt)]))
    for _ in range(3):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        with torch.enable_grad():
            opt.step()
    return params, opt


def test_fused_adam_takes_the_same_step():
    """cpu.fused_adam switches torch AdamW inside a megatron optimizer to its fused CPU kernel: the
    same update as the per-tensor loop."""
    from ftcore.runtime import cpu

    (mine, opt), (ref, _) = _adamw_steps(cpu.fused_adam), _adamw_steps()
    assert opt.param_groups[0]["fused"]
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_dynamo_step_takes_the_same_step():
    """cpu.no_dynamo_step gives torch's AdamW (fused, as on the CPU runtime) a step without the
    wrapper that imports torch._dynamo: bit for bit the wrapper's update, grad mode off inside as
    there; an optimizer with a step hook keeps the wrapper (the hook still runs)."""
    from ftcore.runtime import cpu

    (mine, opt), (ref, _) = _adamw_steps(cpu.no_dynamo_step, fused=True), _adamw_steps(fused=True)
    assert "step" in vars(opt)
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)
    assert opt.state[mine[0]]["step"].item() == 3
    calls = []
    _, hooked = _adamw_steps(cpu.no_dynamo_step, hook=lambda *a: calls.append(1), fused=True)
    assert "step" not in vars(hooked) and len(calls) == 3


def test_cluster_device_cpu_on_a_gpu_machine_runs_on_the_cpu(tmp_path):
    """Issue 50 item 9: `cluster.device=cpu` where CUDA is available built megatron's model on
    cuda:0 for every rank over gloo (the CPU runtime stood aside whenever CUDA existed). Here a
    training process is told CUDA is available; this torch has none, so a model put on "the GPU"
    fails: the run must train on the CPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.tiny import TINY

    root = Path(__file__).resolve().parents[3]
    argv = [*TINY, "cluster.device=cpu", "train.max_steps=1", f"run.dir={tmp_path}"]
    code = (
        "import runpy, sys, torch\n"
        "torch.cuda.is_available = lambda: True  # a machine with an H100\n"
        "torch.cuda.get_device_capability = lambda *a: (9, 0)\n"
        f"sys.argv = ['ftcore.train', *{argv!r}]\n"
        "runpy.run_module('ftcore.train', run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"loss"' in (tmp_path / "metrics.jsonl").read_text()
