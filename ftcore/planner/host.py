"""This machine's own rates, for CPU clusters that ask for them (`cluster.host_probe: true`).

A GPU type's peak is a datasheet number; a CPU host's is not: the VMs ftcore's CPU runs land on
differ by 1.9x in one thread's fp32 matmul rate (86 and 163 GFLOP/s measured) at the same memory
bandwidth, and a host with AMX runs bf16 matmuls 8x faster than fp32 where another has no bf16
units at all.
local_cpu's fitted constants (matmul_efficiency, per-layer host cost, link rate) are fractions of
and additions to these two rates, so measuring the rates where the planner runs keeps its step
time honest on any host. The probe is what the yaml's nominal numbers were read with: one thread,
a 1024^3 matmul in fp32 and in bf16 and torch.add over 64 MiB fp32 tensors, the median of seven
runs each. The whole sequence runs twice and each rate keeps its higher reading: another process
can only slow a reading down, and a ~0.1 s burst of it (seen once in a layouts benchmark: fp32
98 GFLOP/s between readings of 160) would otherwise set a run's prediction, while the VM's slow
phases last minutes and show in both passes. It takes ~0.8 s, once per process (the layouts
benchmark clears the cache to probe again before each run). On a host without bf16 units one
1024^3 bf16 matmul takes seconds (measured: 3 s, 0.7 GFLOP/s), and the probe took 53 s: there the
rate is read on a smaller matmul, the largest power of two from 256 whose call stays under SLOW_S
(256^3 read 1.8 GFLOP/s on that host: still 20x below its fp32 rate, which is what the planner
needs to know), so the probe stays near a second everywhere.
"""

from __future__ import annotations

import functools
import statistics
import time

from ftcore.planner.view import replace, view

MATMUL_N = 1024
ADD_ELEMS = 16 * 1024 * 1024  # 64 MiB of fp32
TRIES = 7
PASSES = 2
SLOW_S = 0.1  # a matmul slower than this is read on a smaller size (the fp32 1024^3 one: ~0.02 s)


def _median_s(fn, tries: int = TRIES) -> float:
    fn()  # warm caches and the allocator
    times = []
    for _ in range(tries):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _matmul_tflops(dtype) -> float:
    """One thread's rate on an n^3 matmul, n = 1024 unless a call would take over SLOW_S there."""
    import torch  # lazy: the planner is part of the config checks, which run before torch loads

    n = MATMUL_N // 4
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype)
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        if n == MATMUL_N or 8 * (time.perf_counter() - t) > SLOW_S:  # the next size costs 8x
            break
        n *= 2
    return 2 * n**3 / _median_s(lambda: torch.mm(a, b, out=out)) / 1e12


@functools.cache
def probe() -> dict[str, float]:
    """One thread's dense matmul rates in TFLOP/s ("fp32", "bf16") and add bandwidth ("gbps")."""
    import torch  # lazy: as above, only a CPU cluster with host_probe measures anything

    x, y = torch.randn(ADD_ELEMS), torch.randn(ADD_ELEMS)
    z = torch.empty(ADD_ELEMS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rates = {"fp32": 0.0, "bf16": 0.0, "gbps": 0.0}
    try:
        for _ in range(PASSES):
            reading = {
                "fp32": _matmul_tflops(torch.float32),
                "bf16": _matmul_tflops(torch.bfloat16),
                "gbps": 3 * ADD_ELEMS * 4 / _median_s(lambda: torch.add(x, y, out=z)) / 1e9,
            }
            rates = {k: max(rates[k], reading[k]) for k in rates}
    finally:
        torch.set_num_threads(threads)
    return rates


def probes(cfg) -> bool:
    """Whether the planner measures this host's rates for the cluster (a CPU cluster that asks)."""
    c = cfg.cluster
    return bool(getattr(c, "host_probe", False)) and c.device == "cpu"


def measured(cfg):
    """The config with the cluster's peaks and bandwidth replaced by this host's, where it asks;
    otherwise the config as it is."""
    cfg = view(cfg)
    if not probes(cfg):
        return cfg
    rates = probe()
    peaks = {"fp32": rates["fp32"], "bf16": rates["bf16"]}
    return replace(cfg, cluster={"peak_tflops": peaks, "hbm_gbps": rates["gbps"]})
