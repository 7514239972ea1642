"""What a mixture-of-experts layer costs beyond its FLOPs at the large-GEMM rate (throughput.py
adds these to a micro-batch's time; the constants are fitted per GPU generation, calibration.py):

- **Expert GEMMs by size**: a routed expert's GEMMs run at matmul_efficiency x W / (W + W½), W one
  expert's weight on the rank (hidden x width / etp): small experts run far below the large-GEMM
  rate (`expert_gemm_half_elems`).
- **Kernel latency**: a MoE layer runs many small kernels (router, permutation, each expert's
  casts and GEMMs, unpermutation) that each take a launch latency on the GPU whatever their size,
  so a layer takes a fixed time per micro-batch beyond its FLOPs and bytes
  (`moe_layer_latency_s`, forward and backward; throughput.micro_batch_time).
- **Dropless sync**: megatron's alltoall dispatcher without `moe_pad_expert_input_to_capacity`
  (the only mode ftcore runs; a capacity factor drops tokens but keeps the sync) copies the token
  counts per expert to the host before its all-to-all (token_dispatcher.py, `cuda_sync_point`).
  The host waits for the GPU there, so it cannot run ahead of it across layers: after the sync
  it launches the dispatch, each local expert's kernels and the combine while the GPU has only
  those to run. A layer's forward MoE part therefore takes at least the host's launch time,
  `expert_host_s` x local experts, and the GPU idles for what of it exceeds its own forward work
  on the experts and the all-to-all. This is the host-bound floor of small micro-batches on fast
  GPUs (a micro-batch cannot take less than its launches): Qwen3-30B-A3B on 8 B200 runs 2.9x
  slower per token at micro-batch 1 than at 4 (Megatron-Bridge 26.02 and 26.02.01), and 2x
  slower dropless than padded to capacity at micro-batch 1 (25.09). Backward has no sync (the
  counts are known), so its launches overlap the GPU. The host constant is per machine: a DGX
  B200's x86 host and a Grace host (GB200, GB300) differ.
"""

from __future__ import annotations

from ftcore.planner import activations as act
from ftcore.planner import calibration
from ftcore.planner.flops import micro_batch_work


def expert_slowdown(k: calibration.Calibration, sh: act.Shape) -> float:
    """How much longer a routed expert's GEMMs take than large GEMMs at matmul_efficiency, less 1
    (0: at the large-GEMM rate): W½ / W."""
    return k.expert_gemm_half_elems / sh.expert_elems


def forwards(cfg) -> int:
    """Forward passes per micro-batch (the recomputed one and the DPO reference's included): each
    syncs once per MoE layer."""
    return 1 + (cfg.parallel.recompute == "full") + act.reference_forwards(cfg)


def _gemm_passes(cfg) -> int:
    """GEMM passes over the experts per micro-batch, as flops.micro_batch_work counts them:
    forward, dgrad, wgrad (full training only) and the extra forwards."""
    return (3 if cfg.peft.name == "none" else 2) + forwards(cfg) - 1


def latency_s(cfg, moe_layers: int) -> float:
    """The MoE layers' fixed kernel time of one micro-batch: a forward is a third of a layer's
    forward and backward, and the extra forwards (recompute, reference) add theirs."""
    k = calibration.of(cfg.cluster)
    return moe_layers * k.moe_layer_latency_s * (2 + forwards(cfg)) / 3


def dropless_sync_s(cfg, pp_rank: int, peaks: dict[str, float], a2a_s: float) -> float:
    """Seconds one micro-batch on one pipeline rank waits for the host after the dropless
    token-count sync of its MoE layers (0 on CPU, on a dense model, and where the cluster has no
    host constant). `peaks`: FLOP/s of the base and quantized GEMMs; `a2a_s`: the rank's exposed
    all-to-all seconds of the micro-batch (ep.a2a_seconds: two per forward or backward pass)."""
    k = calibration.of(cfg.cluster)
    w = micro_batch_work(cfg, pp_rank)
    if cfg.cluster.device == "cpu" or not w.moe_layers or not k.expert_host_s:
        return 0.0
    sh = act.shape_of(cfg)
    slow = 1 + expert_slowdown(k, sh)
    experts = slow * (w.expert_quant / peaks["quant"] + w.expert_base / peaks["base"])
    experts /= k.matmul_efficiency
    a2a_passes = 2 + (cfg.parallel.recompute == "full")
    gpu = (experts / _gemm_passes(cfg) + a2a_s / a2a_passes) / w.moe_layers  # one layer's forward
    host = k.expert_host_s * sh.local_experts
    return w.moe_layers * forwards(cfg) * max(0.0, host - gpu)
