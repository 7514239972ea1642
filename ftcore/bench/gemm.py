"""The host's fp32 GEMM rate: what a run's model FLOP/s is divided by (bench/cpu_vs_hf efficiency).

Measured in a fresh process with the same number of torch threads as the runs, just before and
just after each model's runs of a round (this VM's speed drifts over minutes; the faster of the
two counts): the best of several large square fp32 matmuls,
after one to warm up. A large square GEMM is the fastest thing the host does in fp32 (compute
bound, every core busy), so model FLOP/s over this rate is the share of the physical limit a run
reaches; `bench.gemm_size` (default 2048) can be raised where a host needs larger ones. Run as
`python -m ftcore.bench.gemm THREADS SIZE REPEATS`; prints one JSON object.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time


def rate(threads: int, size: int = 2048, repeats: int = 8) -> float:
    """FLOP/s of the best of `repeats` size x size fp32 matmuls on `threads` threads, here."""
    import torch

    torch.set_num_threads(max(1, threads))
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)  # warm-up: thread pool, pages
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def measure(threads: int, size: int = 2048, repeats: int = 8, timeout_s: float = 300) -> dict:
    """rate() in a fresh process (no state left by the caller): {"flops_per_s", "threads",
    "size", "repeats"}; flops_per_s is None when it failed."""
    cmd = [sys.executable, "-m", "ftcore.bench.gemm", str(threads), str(size), str(repeats)]
    info = {"threads": threads, "size": size, "repeats": repeats, "flops_per_s": None}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        info["flops_per_s"] = float(json.loads(out.stdout.strip().splitlines()[-1])["flops_per_s"])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError, KeyError):
        pass
    return info


if __name__ == "__main__":
    t, n, r = (int(x) for x in sys.argv[1:4])
    print(json.dumps({"flops_per_s": rate(t, n, r)}))
