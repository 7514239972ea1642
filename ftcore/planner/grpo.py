"""objective=grpo's step, priced apart: the rollout (prompts read, then one token at a time), the
forward-only passes of each rollout (reference log-probs with beta != 0, the rollout policy's with
num_iterations > 1), and the update the rest of the planner prices as any step (docs/grpo.md).

Decoding (inference/generation.py) feeds one position per row per forward through megatron's
schedule, one micro-batch: the pipeline stages run one after another, so one token costs the sum
over the stages of
  max(bytes read / HBM bandwidth, FLOPs / (peak x matmul_efficiency))
where the bytes are the stage's weights (all of them, every token: decode is memory-bandwidth-
bound at these batch sizes) and its layers' KV cache, plus what does not shrink with the batch: a
host cost per layer (a forward third of the calibration's per-layer, per-micro-batch cost), a
latency per TP all-reduce and PP send, and the sampling on the host (ftcore copies the last
stage's [rows, vocab] logits to the CPU and draws each row from its own generator). The prompts
are read in one forward (compute-bound). Under sequence parallelism the decoder keeps no cache
and recomputes the prefix at every token (the price says so). Every completion is priced at
max_completion_length and every prompt at data.seq_len - max_completion_length: an upper bound
(finished rows leave the batch).

The rollout runs on the training layout: each data-parallel replica decodes its own share of the
train.global_batch_size completions. Its memory is the KV cache, which lives while no training
activation does (`rollout_bytes`, the larger of the two counts).
"""

from __future__ import annotations

from omegaconf import DictConfig

from ftcore.planner import activations as act
from ftcore.planner import calibration
from ftcore.planner.flops import n_prime
from ftcore.planner.layers import split_for

HBM_EFFICIENCY = 0.7  # as throughput.py: achievable share of HBM bandwidth
COLLECTIVE_LATENCY_S = 15e-6  # one small NCCL all-reduce or send inside a node (assumed)
HOST_COPY_GBPS = 20.0  # device-to-host copy of the logits (PCIe 5 effective, assumed)
DRAW_S = 20e-6  # one row's torch.multinomial on the host (assumed)


def active(cfg: DictConfig) -> bool:
    o = getattr(cfg, "objective", None)
    return o is not None and o.name == "grpo"


def _dp(cfg: DictConfig, world: int) -> int:
    p = cfg.parallel
    return max(world // (p.tp * p.pp * p.cp), 1)


def _lengths(cfg: DictConfig) -> tuple[int, int]:
    """(prompt, completion) tokens priced: the longest each can be."""
    completion = int(cfg.objective.max_completion_length)
    return max(cfg.data.seq_len - completion, 1), completion


def rows(cfg: DictConfig, world: int) -> int:
    """Completions one replica decodes per rollout."""
    return max(cfg.train.global_batch_size // _dp(cfg, world), 1)


def _stage_layers(cfg: DictConfig) -> list[int]:
    return [sum(s) for s in split_for(cfg)]


def kv_cache_bytes(cfg: DictConfig, world: int, pp_rank: int) -> int:
    """One GPU's KV cache at the end of a rollout: keys and values of its layers for its replica's
    rows, every position, its kv heads (none under sequence parallelism: no cache kept)."""
    m, p = cfg.model, cfg.parallel
    if not active(cfg) or p.sp:
        return 0
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    prompt, completion = _lengths(cfg)
    per_token = 2 * (m.num_query_groups // p.tp) * d * act.DTYPE_BYTES[cfg.precision.params_dtype]
    return _stage_layers(cfg)[pp_rank] * rows(cfg, world) * (prompt + completion) * per_token


def frozen_reference(cfg: DictConfig) -> bool:
    """Full fine-tuning with a KL term keeps a frozen copy of the starting weights (as DPO)."""
    return active(cfg) and bool(cfg.objective.beta) and cfg.peft.name == "none"


def rollout_bytes(cfg: DictConfig, world: int, pp_rank: int) -> int:
    """A rollout's transient bytes on one GPU: the KV cache, and on the last stage the fp32
    logits of one decoding step (gathered over TP: every row's full vocab)."""
    if not active(cfg):
        return 0
    logits = (
        rows(cfg, world) * cfg.model.vocab_size * 4 * 2 if pp_rank == cfg.parallel.pp - 1 else 0
    )
    return kv_cache_bytes(cfg, world, pp_rank) + logits


def _rates(cfg: DictConfig) -> tuple[float, float, float]:
    """(FLOP/s, HBM bytes/s, host seconds per layer and forward) of one GPU."""
    c = cfg.cluster
    k = calibration.of(c)
    peaks = c.peak_tflops
    peak = float(peaks.get(cfg.precision.params_dtype) or peaks.get("bf16") or 1.0) * 1e12
    hbm = max(c.hbm_gbps, 1e-3) * 1e9 * HBM_EFFICIENCY
    return peak * k.matmul_efficiency, hbm, k.layer_overhead_s / 3


def decode_token_s(cfg: DictConfig, world: int, weight_bytes: list[int], context: int) -> float:
    """One decoding step of a replica: every stage in turn reads its weights and its KV cache of
    `context` positions; plus host, latency and sampling costs (module docstring)."""
    m, p = cfg.model, cfg.parallel
    flops_rate, hbm, host = _rates(cfg)
    n = rows(cfg, world)
    layers = _stage_layers(cfg)
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    ab = act.DTYPE_BYTES[cfg.precision.params_dtype]
    total = 0.0
    for r in range(p.pp):
        share = layers[r] / max(sum(layers), 1)
        if p.sp:  # no cache: the whole prefix again, compute-bound
            flops = 2.0 * n_prime(cfg) * share * n * context / p.tp
            total += flops / flops_rate + weight_bytes[r] / hbm
        else:
            kv = layers[r] * n * context * 2 * (m.num_query_groups // p.tp) * d * ab
            flops = 2.0 * n_prime(cfg) * share * n / p.tp
            total += max((weight_bytes[r] + kv) / hbm, flops / flops_rate)
        total += layers[r] * host
        if p.tp > 1:
            total += 2 * layers[r] * COLLECTIVE_LATENCY_S  # attention's and the MLP's all-reduce
    total += (p.pp - 1) * COLLECTIVE_LATENCY_S
    sampling = n * m.vocab_size * 4 / (HOST_COPY_GBPS * 1e9) + n * DRAW_S
    return total + sampling


def prefill_s(cfg: DictConfig, world: int) -> float:
    """The prompts read in one forward: compute-bound."""
    flops_rate, _, host = _rates(cfg)
    prompt, _ = _lengths(cfg)
    flops = 2.0 * n_prime(cfg) * rows(cfg, world) * prompt / cfg.parallel.tp
    return flops / flops_rate + cfg.model.num_layers * host


def price(cfg: DictConfig, world: int, weight_bytes: list[int], update_s: float,
          update_compute_s: float) -> dict:  # fmt: skip
    """Seconds of a GRPO step apart: the rollout (decode), the forward-only passes and the update,
    each per step (a rollout serves num_iterations steps), and the rollout's share of a step.
    `weight_bytes`: each stage's weights per GPU (the planner's memory terms); `update_s` and
    `update_compute_s`: the update's step time and its compute (throughput.py)."""
    o = cfg.objective
    prompt, completion = _lengths(cfg)
    # linear in the context where it is the KV cache (or the recomputed prefix) that grows: the
    # mean context's step, completion times
    decode = completion * decode_token_s(cfg, world, weight_bytes, prompt + completion // 2)
    rollout = prefill_s(cfg, world) + decode
    # a forward-only pass over the rollout's rows: the forward third of the update's compute
    # (LoRA's update is 4N' a token, a forward 2N'; full fine-tuning 6N' and 2N')
    forward_share = 0.5 if cfg.peft.name in ("lora", "qlora") else 1 / 3
    passes = (1 if o.beta else 0) + (1 if o.num_iterations > 1 else 0)
    forward_only = passes * forward_share * update_compute_s
    mu = max(int(o.num_iterations), 1)
    step = rollout / mu + forward_only / mu + update_s
    return {
        "rollout_s": rollout,
        "prefill_s": prefill_s(cfg, world),
        "decode_token_s": decode / completion,
        "forward_only_passes": passes,
        "forward_only_s": forward_only,
        "update_s": update_s,
        "num_iterations": mu,
        "step_time_s": step,
        "rollout_share": rollout / mu / step,
        "completions_per_replica": rows(cfg, world),
        "priced_lengths": {"prompt": prompt, "completion": completion},
        "kv_cache_recomputed": bool(cfg.parallel.sp),
    }
