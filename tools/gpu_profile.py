"""Where a training step's time goes on one GPU: `python tools/gpu_profile.py OUT.txt OVERRIDES...`.

Sets a run up from the overrides (as `python -m ftcore.train` would), trains WARMUP steps, then
profiles STEPS more with torch.profiler, and writes: each step's wall time, the GPU's kernel time
per step (busy share of the wall: below 1 means the GPU waited for the host), and the ops that
take the most GPU time and the most host time, then the host-heavy ops again grouped by the
Python line that called them (a second pass with stacks: stacks slow the host, so the timed pass
has none). Runs on CPU too (host time only), to check it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

WARMUP, STEPS = 6, 6


def kernel_seconds(events) -> float:
    """Seconds the GPU ran kernels and copies. Only the events on the device count: an op on the
    host also carries its kernels' time, so summing every event counts each kernel twice (the
    first H200 report's "busy 51%" was 25%)."""
    from torch.autograd import DeviceType

    on_gpu = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    return sum(e.self_device_time_total for e in on_gpu) / 1e6


def by_caller(events, rows: int = 25) -> list[str]:
    """Host time of each (op, innermost ftcore Python function above it), the largest first: which
    line of ours a host-heavy op comes from. The Python tracer records functions as events, so an
    op's caller is its nearest ancestor event named `ftcore/...`."""
    import torch

    total: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if ".py(" in e.name or e.name.startswith("<built-in"):
            continue  # Python frames themselves: their ops are counted
        ours = [f for f in (e.stack or []) if "ftcore/" in f]  # where torch records stacks
        caller = ours[0][ours[0].rindex("ftcore/") :] if ours else "(no ftcore frame)"
        up = None if ours else e.cpu_parent
        while up is not None:
            if ".py(" in up.name and "ftcore/" in up.name:  # the path may be absolute
                caller = up.name[up.name.rindex("ftcore/") :]
                break
            up = up.cpu_parent
        t = total.setdefault((e.name, caller), [0.0, 0])
        t[0] += e.self_cpu_time_total
        t[1] += 1
    if all(caller == "(no ftcore frame)" for _, caller in total):
        # torch 2.11+cu130 on an H200 recorded neither stacks nor Python frames here
        return [f"torch {torch.__version__} recorded no Python frames: no caller to name"]
    top = sorted(total.items(), key=lambda kv: -kv[1][0])[:rows]
    return [f"{us / 1e3:9.2f} ms {n:6d} calls  {op}  <-  {caller}" for (op, caller), (us, n) in top]


def main(out: str, overrides: list[str]) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ftcore.config.schema import compose
    from ftcore.training import trainer

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    state = trainer.setup(compose(overrides))
    for _ in range(WARMUP):
        trainer.train_step(state)
    sync()
    walls = []
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(STEPS):
            t0 = time.perf_counter()
            trainer.train_step(state)
            sync()
            walls.append(time.perf_counter() - t0)
    events = prof.key_averages()
    kernel_s = kernel_seconds(events) / STEPS
    wall = sum(walls) / STEPS
    lines = [f"overrides: {' '.join(overrides)}",
             f"step wall s: {', '.join(f'{w:.3f}' for w in walls)} (mean {wall:.3f})",
             f"GPU kernel s per step: {kernel_s:.3f} (busy {kernel_s / wall:.0%} of the wall)"
             if cuda else "no GPU: host time only", ""]  # fmt: skip
    if cuda:
        lines += [
            "## by GPU time",
            events.table(sort_by="self_device_time_total", row_limit=20),
            "",
        ]
    lines += ["## by host time", events.table(sort_by="self_cpu_time_total", row_limit=20), ""]
    with profile(activities=acts, with_stack=True) as prof:
        for _ in range(2):
            trainer.train_step(state)
            sync()
    lines += ["## by host time, with the ftcore function that called them (2 steps, stacks on)",
              *by_caller(prof.events())]  # fmt: skip
    text = "\n".join(lines)
    Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1], sys.argv[2:])
