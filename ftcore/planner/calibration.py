"""The planner's fitted constants, per cluster: what a step gets of the hardware's rates, and the
costs those rates do not explain.

conf/cluster/*.yaml holds the hardware's facts (memory, datasheet peaks, bandwidths, topology).
The numbers here are not facts but the fit of the time model (throughput.py) to measured steps,
and two allowances set with that fit:

- h100, h200: GEMMs at 0.62 of the dense peak, fitted (fit.py: the worst row's error minimised)
  to the published rows of NVIDIA's Megatron-Bridge performance summary (archive 26.06) and
  NeMo's (24.07 container) on H100: llama3_70b LoRA on 8 (2643 tokens/s/GPU), llama3_70b SFT on
  32 (1638), llama31_405b pretraining on 1024 (326), llama2_7b LoRA on 8 (24824). Flash attention
  at 0.6 of the bf16 peak is set, not fitted: the rows do not separate it from the GEMMs. Each row
  is within 5.5% in sample, within 7.1% when left out of the fit (docs/planner.md). H200 has no
  published row: it is the same Hopper GPU with more and faster HBM (its yaml), so H100's constants.
- h100, h200, MoE only (moe_fit.py): an expert's GEMMs at matmul_efficiency x W / (W + 2.3e7),
  W its weight's elements (hidden x width / etp), and 0.77 of the all-to-all hidden where
  plan.moe_a2a_overlap (megatron's overlap_moe_expert_parallel_comm) is on: solved on one
  Megatron-Bridge 25.11 H100 row of Qwen3-30B-A3B and one of Qwen3-235B-A22B, the 26.02 rows held
  out (docs/planner.md). Blackwell has its own (below).
- b200, gb200: 0.52 and 0.55 (set), from the one Blackwell dense row, llama3_70b LoRA on 8 GB200
  (6206 tokens/s/GPU, Megatron-Bridge 26.06; predicted 4.5% high: fit.py gives 0.49 for an exact
  fit, the shipped value is kept for now). Held out, that row is 19% high on H100's constants.
  B200 has no fitted row: GB200's constants on its lower datasheet peaks (lower clocks); its two
  held-out rows are within 2%.
- gb300: 0.68 (fit.py, the worst row's error minimised) to its own rows, llama3_70b SFT on 32
  (4819) and llama31_405b pretraining on 256 (1048), Megatron-Bridge 26.06: GB300 has GB200's
  datasheet FP8/BF16 peaks but runs ~20% faster on every layout both published (1,400 W against
  1,200 W). The held-out GB300 LoRA row (7481) is predicted within 5%.
- b200, gb200, gb300, MoE only (moe_fit_blackwell.py): expert GEMMs at matmul_efficiency x
  W / (W + 3.2e6), 0.47 of the all-to-all hidden where plan.moe_a2a_overlap is on, 1.79 ms of
  kernel latency per MoE layer and micro-batch, and the dropless sync's host launch time per local
  expert: 0.23 ms on a DGX B200's x86 host, 0 on the Grace hosts of GB200/GB300 (no row of theirs
  is host-bound: not measured to be 0). Fitted (least squares in log) to 15 Blackwell rows of
  Megatron-Bridge 25.09, 26.02 and 26.02.01; the six 25.11 rows held out (median 9.4%, worst
  15.6%, docs/planner.md). Hopper's set put those rows 56% too fast at the median: one set cannot
  serve both generations.
- On every GPU cluster: 0.05 s per step (launch, Python) and a reserve per GPU for the CUDA
  context, NCCL and cuBLAS/TE workspaces and allocator fragmentation (5 GiB Hopper, 6 GiB
  Blackwell). Allowances, not measured one by one.
- local_cpu: fitted on top of the host's own rates (host.py) to the nine layouts of the
  `layouts_cpu` benchmark (2 workers, one thread each; refitted 2026-11-24 to the geometric mean
  of two full runs and two runs of dp2/tp2/tp2-sp: every layout within 11% of it, each of the 22
  runs within 0.81-1.20): GEMM efficiency 0.95, a host cost of 0.01 s per layer and micro-batch
  (Python, autograd, megatron's per-layer work: it dominates a tiny model), 0.007 s more under
  sequence parallelism (its gathers and scatters through gloo cost host time beyond their bytes:
  tp2-sp ran 0.10-0.19 s per step longer than predicted without it), no per-step cost left once
  the per-layer cost is counted, 0.3 GB/s for gloo over loopback (TP all-reduces, PP sends) in
  place of NVLink, and a 0.5 GiB reserve. Attention runs at the GEMM efficiency on CPU.

Every constant is still a `cluster.*` key: a value set in a cluster yaml or on the command line
(`cluster.matmul_efficiency=0.5`) replaces the calibration's. A cluster with no calibration here
gets DEFAULT.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Calibration:
    matmul_efficiency: float = 0.7  # achievable fraction of the dense peak on large GEMMs
    attention_efficiency: float = 0.5  # flash attention, fraction of the bf16 peak
    step_overhead_s: float = 0.0  # fixed cost per step (launch, Python)
    layer_overhead_s: float = 0.0  # host cost per layer and micro-batch (Python, autograd)
    sp_layer_overhead_s: float = 0.0  # what sequence parallelism adds to it
    expert_gemm_half_elems: float = 0.0  # expert GEMMs: size (hidden x width) at half efficiency
    ep_a2a_hidden: float = 0.0  # share of the MoE all-to-all hidden where plan.moe_a2a_overlap
    moe_layer_latency_s: float = 0.0  # GPU time of a MoE layer's kernels whatever their size
    expert_host_s: float = 0.0  # dropless MoE: host launch time per local expert after the sync
    reserve_gib: float = 0.0  # per GPU: CUDA context, NCCL/cuBLAS workspaces, fragmentation
    nvlink_gbps: float = 0.0  # a fitted link rate where the link is no hardware (gloo)


DEFAULT = Calibration()
HOPPER = Calibration(0.62, 0.6, step_overhead_s=0.05, reserve_gib=5.0,
                     expert_gemm_half_elems=2.3e7, ep_a2a_hidden=0.77)  # fmt: skip
# Blackwell's MoE constants (moe_fit.py: fitted to the Blackwell MoE rows of Megatron-Bridge 25.09,
# 26.02 and 26.02.01; the 25.11 rows held out). The host constant is per machine: x86 (DGX B200)
# or Grace (GB200, GB300).
BLACKWELL_MOE = dict(expert_gemm_half_elems=3.2e6, ep_a2a_hidden=0.47, moe_layer_latency_s=0.00179)
BLACKWELL = Calibration(0.52, 0.55, step_overhead_s=0.05, reserve_gib=6.0, **BLACKWELL_MOE)
B200 = replace(BLACKWELL, expert_host_s=0.00023)
GB300 = replace(BLACKWELL, matmul_efficiency=0.68)
LOCAL_CPU = Calibration(0.95, 0.6, layer_overhead_s=0.01, sp_layer_overhead_s=0.007,
                        reserve_gib=0.5, nvlink_gbps=0.3)  # fmt: skip

CALIBRATIONS = {
    "h100": HOPPER,
    "h200": HOPPER,
    "b200": B200,
    "gb200": BLACKWELL,
    "gb300": GB300,
    "local_cpu": LOCAL_CPU,
}
KEYS = tuple(f.name for f in fields(Calibration))  # each also a cluster.* key


def of(cluster) -> Calibration:
    """The constants the planner uses on `cluster` (a config section): the calibration of its
    name, with every key the cluster sets (not null) in place of the fitted one."""
    given = {k: v for k in KEYS if (v := getattr(cluster, k, None)) is not None}
    return replace(CALIBRATIONS.get(cluster.name, DEFAULT), **given)
