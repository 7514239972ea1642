"""Where a training step's time goes on one GPU: `python tools/gpu_profile.py OUT.txt OVERRIDES...`.

Sets a run up from the overrides (as `python -m ftcore.train` would), trains WARMUP steps, then
profiles STEPS more with torch.profiler, and writes: each step's wall time, the GPU's kernel time
per step (busy share of the wall: below 1 means the GPU waited for the host), and the ops that
take the most GPU time and the most host time. Runs on CPU too (host time only), to check it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

WARMUP, STEPS = 6, 6


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
    kernel_s = sum(e.self_device_time_total for e in events) / 1e6 / STEPS if cuda else 0.0
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
    lines += ["## by host time", events.table(sort_by="self_cpu_time_total", row_limit=20)]
    text = "\n".join(lines)
    Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1], sys.argv[2:])
