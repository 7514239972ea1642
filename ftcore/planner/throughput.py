"""Step time and tokens/s/GPU of a layout, from the hardware of conf/cluster/*.yaml and the
constants fitted per cluster in calibration.py.

One micro-batch on one pipeline rank costs
  GEMMs / (peak[precision] * matmul_efficiency)      FP8/FP4 where the recipe quantizes, else bf16
+ attention / (peak[bf16] * attention_efficiency)    flash attention stays in bf16
+ elementwise bytes / HBM bandwidth                  norms, RoPE, SwiGLU, residuals, FP8 casts, loss
+ exposed tensor-parallel traffic                    over NVLink (or the network beyond the domain)
+ exposed context-parallel KV exchange               per parallel.cp_comm_type (cp.py)
+ the MoE all-to-alls (dispatch, combine)             per link: NVLink inside a node, else the network (ep.py)
                                                     less the share megatron's overlap hides, where on
and a step is (micro-batches + (pp - 1) / vp) of the slowest rank's micro-batch (1F1B or
interleaved pipeline bubble), plus the exposed pipeline sends, the data-parallel gradient
reduce-scatter / parameter all-gather, the optimizer's pass over its shard, and a fixed overhead.
The constants are per GPU type; the fractions below are the same for every GPU. Calibrated once
against tests/data/published_throughput.csv (tests/unit/planner/test_throughput.py). A CPU
cluster with host_probe measures its peak and bandwidth on the host instead (host.py), and MFU is
taken against that measured peak. A routed expert's GEMMs run below matmul_efficiency by the
expert's size, and the MoE router, permutation and per-copy FP8 casts are bytes at HBM speed: Hopper's
two MoE constants are fitted apart (moe_fit.py) and are 0 on a dense model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from omegaconf import DictConfig

from ftcore.planner import activations as act
from ftcore.planner import calibration, cp, ep, host, moe_time
from ftcore.planner.flops import (
    FLASH_BWD,
    attention_forward_flops,
    micro_batch_work,
    model_flops_per_token,
)
from ftcore.planner.memory import expert_dp, grad_bytes, model_state
from ftcore.planner.view import view

LINK_EFFICIENCY = 0.8  # achievable fraction of a link's bandwidth in NCCL collectives
HBM_EFFICIENCY = 0.7  # achievable fraction of HBM bandwidth for elementwise kernels
TP_EXPOSED = 0.7  # tensor-parallel collectives not hidden behind GEMMs (TE comm overlap)
P2P_EXPOSED = 0.5  # pipeline sends not hidden (overlapped in the interleaved schedule)
DP_EXPOSED = 0.2  # gradient reduce / param gather not hidden behind backward / forward
# The exposed shares above hold where the run overlaps that traffic (parallel.tp_comm_overlap,
# overlap_p2p_comm, overlap_grad_reduce / overlap_param_gather; docs/gpu_speed.md): fitted with the
# published rows, whose recipes overlap all of it. Without the overlap a GPU waits for all of it.
# On CPU gloo runs every collective in line either way; local_cpu's link rate was fitted with the
# shares above, so they stay (the overlap flags do not move a CPU plan).
NOT_OVERLAPPED = 1.0
OVERLAP_FLAG = {
    "tp": "tp_comm_overlap",
    "p2p": "overlap_p2p_comm",
    "dp_grads": "overlap_grad_reduce",
    "dp_params": "overlap_param_gather",
}
FITTED_SHARE = {
    "tp": TP_EXPOSED,
    "p2p": P2P_EXPOSED,
    "dp_grads": DP_EXPOSED,
    "dp_params": DP_EXPOSED,
}


def exposed(cfg: DictConfig, traffic: str) -> float:
    """Share of one kind of traffic (tp | p2p | dp_grads | dp_params) the step waits for."""
    if cfg.cluster.device == "cpu" or getattr(cfg.parallel, OVERLAP_FLAG[traffic], True):
        return FITTED_SHARE[traffic]
    return NOT_OVERLAPPED


# router bytes per token and expert, forward: fp32 logits written, softmax read and written, top-k
# read (4 x 4 B), the [experts, tokens] routing map and probabilities (1 + 4 B) written, then read
# by the permutation
ROUTER_BYTES = 4 * 4 + 2 * 5
OPTIM_BYTES = 40  # bytes moved per optimizer element: param, grad, main, 2 moments, read + write


@dataclass
class StepTime:
    compute_s: float  # micro-batches x slowest rank's micro-batch
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    optimizer_s: float
    overhead_s: float
    ep_comm_s: float = 0.0  # MoE all-to-alls (and expert-TP gathers), exposed
    host_bound_s: float = 0.0  # what the kernel launches add where they outlast the GPU's work

    @property
    def total(self) -> float:
        return (
            self.host_bound_s
            + self.ep_comm_s
            + self.compute_s
            + self.bubble_s
            + self.tp_comm_s
            + self.pp_comm_s
            + self.dp_comm_s
            + self.optimizer_s
            + self.overhead_s
        )


def _peak(cfg: DictConfig, precision: str) -> float:
    """Dense FLOP/s of the cluster's GPU at `precision` (falls back to bf16, then fp32)."""
    peaks = cfg.cluster.peak_tflops
    for key in (precision, "bf16", "fp32"):
        if key in peaks and peaks[key]:
            return float(peaks[key]) * 1e12
    raise ValueError(f"cluster {cfg.cluster.name} has no peak_tflops")


def _peak_of(cfg: DictConfig) -> dict[str, float]:
    """FLOP/s of the base and the quantized GEMMs (moe_time prices expert GEMMs with them)."""
    return {"base": _peak(cfg, _base_precision(cfg)), "quant": _peak(cfg, _quant_precision(cfg))}


def _base_precision(cfg: DictConfig) -> str:
    return cfg.precision.params_dtype


def _quant_precision(cfg: DictConfig) -> str:
    return "fp4" if cfg.precision.fp4_recipe else "fp8"


def _link(cfg: DictConfig, group_span: int) -> float:
    """Bytes/s per GPU for a group spanning `group_span` consecutive ranks."""
    c = cfg.cluster
    nvlink = calibration.of(c).nvlink_gbps
    gbps = nvlink if group_span <= max(c.nvlink_domain, 1) else c.network_gbps
    return max(gbps, 1e-3) * 1e9 * LINK_EFFICIENCY


def elementwise_bytes(sh: act.Shape) -> float:
    """HBM bytes of the memory-bound kernels of one layer, one micro-batch, forward + backward.
    A MoE layer's SwiGLU runs over the routed copies, which are permuted in and out (4 passes over
    [copies, hidden]), and each copy's expert inputs and output gradients are cast to FP8 apart;
    its router writes fp32 logits over the experts and the routing map the permutation reads."""
    t, ab, T = sh.tp, sh.ab, sh.tokens
    mlp = 3 * sh.f / t
    cast_mlp = 3 * sh.f / t + sh.hs  # fc2's input, fc1's and fc2's output gradients
    router = 0.0
    if sh.moe:
        tm, routed = act.moe_tokens(sh)
        r = routed / T  # routed copies per token of this rank
        mlp = r * (3 * sh.fe / sh.etp + 4 * sh.h)
        # per copy also fc1's input (permuted: no norm to fuse its cast into) and fc2's output
        # gradient, besides fc2's input and fc1's output gradient
        cast_mlp = r * (2 * sh.h + 3 * sh.fe / sh.etp)
        router = tm / T * ROUTER_BYTES * sh.experts
    fwd = ab * (10 * sh.hs + 2 * (sh.q + sh.kv) / t + mlp) + router
    cast = 0.0
    if sh.fp8:  # quantize the inputs TE cannot fuse into the norm (proj, fc2) and the output
        # gradients of the four linears; read bf16, write FP8 (+ its transpose, fused)
        cast = (ab + 2) * ((sh.q + sh.q + 2 * sh.kv) / t + sh.hs + cast_mlp)
    return T * (3 * fwd + cast)


def unfused_swiglu_bytes(cfg: DictConfig, sh: act.Shape) -> float:
    """perf.bias_activation_fusion=false on GPU: silu and the product as separate kernels, each
    reading and writing [tokens, ffn/tp] once more, forward and backward (the fused kernel is what
    elementwise_bytes counts, and what the calibration rows ran)."""
    if cfg.cluster.device == "cpu" or getattr(cfg.perf, "bias_activation_fusion", True):
        return 0.0
    return sh.tokens * 3 * 2 * sh.f / sh.tp * sh.ab


def micro_batch_time(cfg: DictConfig, pp_rank: int) -> tuple[float, float]:
    """(compute seconds, exposed TP/CP seconds) of one micro-batch on one pipeline rank."""
    c, p = cfg.cluster, cfg.parallel
    k = calibration.of(c)
    w = micro_batch_work(cfg, pp_rank)
    sh = act.shape_of(cfg)
    base = _peak(cfg, _base_precision(cfg))
    # the routed experts' GEMMs run at matmul_efficiency x W / (W + W_half), W one expert's weight
    # (hidden x width / etp): small experts' grouped GEMMs run far below the large-GEMM rate
    slow = moe_time.expert_slowdown(k, sh) if sh.moe else 0.0
    t = (w.gemm_base + slow * w.expert_base) / (base * k.matmul_efficiency)
    if w.gemm_quant:
        quant = w.gemm_quant + slow * w.expert_quant
        t += quant / (_peak(cfg, _quant_precision(cfg)) * k.matmul_efficiency)
    attn_rate = base * (k.attention_efficiency if c.device != "cpu" else k.matmul_efficiency)
    t += w.attention / attn_rate
    hbm = max(c.hbm_gbps, 1e-3) * 1e9 * HBM_EFFICIENCY
    t += w.layers * (elementwise_bytes(sh) + cp.merge_bytes(sh, p.recompute == "full")) / hbm
    t += w.layers * unfused_swiglu_bytes(cfg, sh) / hbm
    if pp_rank == p.pp - 1:
        t += sh.target_tokens * sh.vocab / sh.tp * 20 / hbm  # logits, fp32 softmax, its gradient
    passes = 2 + (1 if p.recompute == "full" else 0) + act.reference_forwards(cfg)
    # host cost per layer and micro-batch (Python, autograd, kernel launches; sequence parallelism
    # adds its gathers and scatters); a full recompute runs the forward (a third of it) twice
    host = k.layer_overhead_s + (k.sp_layer_overhead_s if p.sp else 0.0)
    t += w.layers * host * ((4 if p.recompute == "full" else 3) + act.reference_forwards(cfg)) / 3
    # a MoE layer's many small kernels (router, permutation, per-expert casts and GEMMs) each cost a
    # launch latency on the GPU whatever their size: a fixed time per MoE layer and micro-batch
    t += moe_time.latency_s(cfg, w.moe_layers)
    comm = 0.0
    if p.tp > 1:
        vol = 4 * (p.tp - 1) / p.tp * sh.tokens * sh.h * sh.ab * passes * w.layers
        comm += exposed(cfg, "tp") * vol / _link(cfg, p.tp)
    if p.cp > 1:  # the KV exchange of parallel.cp_comm_type, less what attention hides (cp.py)
        fwd = attention_forward_flops(cfg) / attn_rate
        attn = (fwd, fwd * FLASH_BWD)
        comm += w.layers * cp.exposed_s(sh, attn, partial(_link, cfg), p.recompute == "full")
    return t, comm


def ep_time(cfg: DictConfig, pp_rank: int, compute_s: float) -> float:
    """Exposed MoE all-to-all seconds of one micro-batch on one pipeline rank (ep.py), less what
    megatron's overlap hides behind the rank's `compute_s` where plan.moe_a2a_overlap says so."""
    w = micro_batch_work(cfg, pp_rank)
    if not w.moe_layers:
        return 0.0
    passes = 2 + (1 if cfg.parallel.recompute == "full" else 0)
    per_layer = ep.a2a_seconds(
        cfg, act.shape_of(cfg), lambda inside: _link(cfg, 1 if inside else 1 << 30), passes
    )
    a2a = w.moe_layers * per_layer
    if cfg.cluster.device != "cpu" and getattr(cfg.plan, "moe_a2a_overlap", False):
        a2a -= min(calibration.of(cfg.cluster).ep_a2a_hidden * a2a, compute_s)
    return a2a


def step_time(cfg: DictConfig, world: int) -> StepTime:
    cfg = host.measured(cfg)  # a CPU host's own matmul rate and bandwidth, where it asks
    c, p, tr = cfg.cluster, cfg.parallel, cfg.train
    dp = max(world // (p.tp * p.pp * p.cp), 1)
    m = max(tr.global_batch_size // (tr.micro_batch_size * dp), 1)
    per_rank = [micro_batch_time(cfg, r) for r in range(p.pp)]
    a2a = [ep_time(cfg, r, a) for r, (a, _) in enumerate(per_rank)]
    # dropless MoE: the forward waits on the host's launches after each layer's token-count sync
    peaks = _peak_of(cfg)
    sync = [moe_time.dropless_sync_s(cfg, r, peaks, e) for r, e in enumerate(a2a)]
    slowest = max(a + b + e + s for (a, b), e, s in zip(per_rank, a2a, sync))
    host_bound = m * max(sync)
    compute = m * max(a for a, _ in per_rank)
    tp_comm = m * max(b for _, b in per_rank)  # exposed TP/CP traffic
    ep_comm = m * max(a2a)
    bubble = (p.pp - 1) / p.vp * slowest if p.pp > 1 else 0.0
    sh = act.shape_of(cfg)
    pp_comm = 0.0
    if p.pp > 1:
        sends = (2 + act.reference_forwards(cfg)) * p.vp * m * sh.tokens * sh.hs * sh.ab
        pp_comm = exposed(cfg, "p2p") * sends / _link(cfg, p.tp * p.cp * dp * p.pp)
    dp_comm = opt = 0.0
    dpc = dp * p.cp
    worst = max((model_state(cfg, r, dpc) for r in range(p.pp)), key=lambda s: s["grads"])
    edp = expert_dp(cfg, dpc)
    ep_size, etp = ep.sizes(cfg)
    buffers = (  # (grads, params, group size, ranks the group spans): dense, then experts
        (worst["grads"] - worst["expert_grads"], worst["trainable"] - worst["expert_trainable"],
         dpc, p.tp * p.cp * dp),
        (worst["expert_grads"], worst["expert_trainable"], edp, p.tp * p.cp * dp),
    )  # fmt: skip
    for grads, params, size, span in buffers:
        if size <= 1 or not grads:
            continue
        share = (size - 1) / size / _link(cfg, span)
        if p.distributed_optimizer:  # reduce-scatter of the grads, all-gather of the params
            dp_comm += share * (
                exposed(cfg, "dp_grads") * grads + exposed(cfg, "dp_params") * params
            )
        else:  # all-reduce of the grads
            dp_comm += share * exposed(cfg, "dp_grads") * 2 * grads
    gbytes = grad_bytes(cfg)
    dense_elems = (worst["grads"] - worst["expert_grads"]) // gbytes
    expert_elems = worst["expert_grads"] // gbytes
    if p.distributed_optimizer:
        dense_elems, expert_elems = dense_elems // dpc, expert_elems // edp
    elems = dense_elems + expert_elems
    opt = elems * OPTIM_BYTES / (max(c.hbm_gbps, 1e-3) * 1e9 * HBM_EFFICIENCY)
    overhead = calibration.of(c).step_overhead_s
    return StepTime(compute, bubble, tp_comm, pp_comm, dp_comm, opt, overhead, ep_comm, host_bound)


def throughput(cfg: DictConfig, world: int) -> dict:
    """Tokens/s/GPU and MFU. MFU is taken against the peak the step time was computed with: a CPU
    host's probed rate where it asks (host_probe), so it stays below the matmul efficiency (< 1)."""
    cfg = host.measured(view(cfg))
    st = step_time(cfg, world)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len * act.rows_per_item(cfg)
    tps = tokens / st.total / world
    tflops = tps * model_flops_per_token(cfg) / 1e12
    if cfg.cluster.device == "cpu":  # a CPU computes in the run's own dtype (its bf16 may be slow)
        dtype = _base_precision(cfg)
        where = "this host's probed" if host.probes(cfg) else "the cluster's"
        basis = f"model FLOPs / {where} {dtype} matmul rate (one thread)"
    else:
        dtype, basis = "bf16", "model FLOPs / dense bf16 peak of the GPU"
    peak = _peak(cfg, dtype) / 1e12
    return {
        "step_time_s": st.total,
        "tokens_per_s_per_gpu": tps,
        "model_tflops_per_gpu": tflops,
        "mfu": tflops / peak,
        "mfu_basis": basis,
        "time": st,
    }
