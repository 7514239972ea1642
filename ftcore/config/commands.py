"""The sections of the machine (`cluster`, `gpu`) and of the commands beside training (`plan`,
`export`, `generate`, `bench`): schema only, merged into FtcoreConfig (groups.py) like the training
sections. None of these keys changes the training path (no `switch`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ClusterConfig:
    name: str = "local_cpu"
    num_gpus: Optional[int] = None  # total devices; null = the processes launched
    gpus_per_node: int = 1
    gpu_mem_gib: float = 24.0
    device: str = "cpu"  # cpu | cuda
    compute_capability: Optional[float] = None  # 9.0 (H100/H200), 10.0 (B200/GB200), 10.3 (GB300)
    # dense per precision: bf16, fp8, fp4
    peak_tflops: dict[str, float] = field(default_factory=dict)
    hbm_gbps: float = 100.0  # memory bandwidth, GB/s: elementwise kernels, optimizer (planner)
    nvlink_domain: int = 1  # GPUs per NVLink domain
    # GB/s per GPU, one direction; null: the calibration's (local_cpu: gloo's fitted rate)
    nvlink_gbps: Optional[float] = None
    network_gbps: float = 0.0  # GB/s per GPU across nodes
    host_probe: bool = False  # CPU only: measure peak_tflops and hbm_gbps here (planner/host.py)
    # The planner's fitted constants: null takes those of cluster.name in
    # ftcore/planner/calibration.py (which says what they were fitted to); a value replaces them.
    matmul_efficiency: Optional[float] = None  # achievable fraction of peak on large GEMMs
    attention_efficiency: Optional[float] = None  # flash attention, fraction of the bf16 peak
    step_overhead_s: Optional[float] = None  # fixed per-step cost (launch, Python)
    layer_overhead_s: Optional[float] = None  # fixed cost per layer and micro-batch (host)
    sp_layer_overhead_s: Optional[float] = None  # what sequence parallelism adds to it (host)
    expert_gemm_half_elems: Optional[float] = None  # expert weight size at half GEMM efficiency
    ep_a2a_hidden: Optional[float] = None  # share of the MoE all-to-all plan.moe_a2a_overlap hides
    # GPU time of a MoE layer's many small kernels per micro-batch whatever their size (fwd + bwd)
    moe_layer_latency_s: Optional[float] = None
    # dropless MoE: the host's launch time per local expert after a layer's token-count sync,
    # forward (planner/moe_time.py dropless_sync_s)
    expert_host_s: Optional[float] = None
    reserve_gib: Optional[float] = None  # framework / allocator reserve per GPU


@dataclass
class GpuConfig:
    # Transformer Engine must be present on a CUDA machine: its absence fails the run's hardware
    # check and the GPU tests (instead of falling back to megatron's local layers / NOT RUN).
    # Default: the environment variable FTCORE_GPU_REQUIRE_TE (ftcore's Dockerfile sets it to 1).
    require_te: bool = "${oc.decode:${oc.env:FTCORE_GPU_REQUIRE_TE,false}}"  # type: ignore[assignment]


@dataclass
class PlanConfig:
    format: str = "table"  # table | json
    search: bool = False
    enforce: bool = True
    top: int = 10
    # share of token positions that are loss targets; logits and the last layer's MLP run only
    # there (models/target_logits.py). 1.0 (every position) bounds memory and time from above.
    target_fraction: float = 1.0
    # the margin `fits` keeps for what is estimated, not measured: this share of the activations
    # (the planner is within 10% of measured activations: docs/planner.md)
    headroom: float = 0.10
    # build each distinct pipeline stage on the meta device (one CPU process, a fake process group
    # of the job's world) and check it against the planner: `dry_build` in the plan, exit 2 when a
    # tensor is off the device or a count differs (ftcore/training/dry_build.py)
    dry_build: bool = False
    # MoE, dropless: the busiest expert's routed tokens over the mean, applied to an EP rank's
    # routed activations and expert time (docs/planner.md); a capacity factor bounds it instead
    moe_imbalance: float = 1.5
    # price the MoE all-to-all as megatron's overlap_moe_expert_parallel_comm hides it (the
    # published MoE rows ran with it); ftcore's own runs do not overlap it: false for them
    moe_a2a_overlap: bool = False


@dataclass
class ExportConfig:
    checkpoint: Optional[str] = None
    output: Optional[str] = None
    merge: bool = False
    dtype: Optional[str] = None  # output dtype; default the checkpoint's
    max_shard_gb: float = 5.0  # size of each safetensors file of hf_model/
    overwrite: bool = False  # replace an existing export.output (refused otherwise)


@dataclass
class GenerateConfig:
    prompt: Optional[str] = None
    # the prompt read from this file ("-": standard input), for text Hydra's parser cannot take
    prompt_file: Optional[str] = None
    system: Optional[str] = None  # a system turn before the prompt (the chat template renders it)
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0  # nucleus sampling, in (0, 1]; 1.0 = off


@dataclass
class BenchConfig:
    name: str = "none"
    warmup_steps: int = 2
    measure_steps: int = 5
    runs: list[Any] = field(default_factory=list)  # each: a list of Hydra overrides or a dict
    kind: str = "layouts"  # layouts (fixed steps per config) | cpu_vs_hf (one epoch, vs HF Trainer)
    base: list[str] = field(default_factory=list)  # overrides every run starts from
    sweep: dict[str, Any] = field(default_factory=dict)  # key -> values: their product, after runs
    threads: Optional[int] = None  # torch threads per process on CPU (both sides of cpu_vs_hf)
    timeout_min: float = 30.0  # per configuration; a run past it is recorded as failed
    output_dir: Optional[str] = None  # default outputs/bench/<name>
    hf: dict[str, Any] = field(default_factory=dict)  # cpu_vs_hf: the HF model shape and batch size
    repeats: int = 1  # cpu_vs_hf: rounds of (HF, then each ftcore run); ratios within a round
    overhead: dict[str, Any] = field(default_factory=dict)  # host_overhead: depths, rows, shape
    turns: int = 0  # cpu_vs_hf: > 0 runs a round's processes side by side, taking turns in this many slices of each epoch
    models: list[Any] = field(default_factory=list)  # cpu_vs_hf: {label, shape} each, over hf.shape
    loss_tolerance: float = 0.02  # cpu_vs_hf: a pair whose eval losses differ more is refused
    gemm_size: int = 2048  # cpu_vs_hf: the square fp32 matmul whose rate efficiency is against
    publish: Optional[str] = None  # hardware name: also write docs/bench/<name>_<hw>_<date>.*
