"""The range of every numeric config field, in one table, checked before anything is built.

A zero or negative size, a NaN learning rate or a fraction above 1 would otherwise reach the
planner or megatron and end in a traceback (exit 1). `check_ranges` turns each into one
FtcoreError (exit 2) naming the field and its range. Where 0 means something it stays allowed
(`checkpoint.interval=0` off, `checkpoint.keep=0` keep all, `eval.interval=0` off).
tests/unit/config/test_ranges.py checks that every int/float field of the schema has an entry here, so a
new field cannot be forgotten.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from ftcore.errors import FtcoreError

INF = math.inf


@dataclass(frozen=True)
class Range:
    lo: float = -INF
    hi: float = INF
    lo_open: bool = False  # lo itself is out of range
    hi_open: bool = False  # hi itself is out of range
    note: str = ""  # what a boundary value means, shown in the error

    def holds(self, v: float) -> bool:
        if not math.isfinite(v):  # NaN compares false everywhere; inf is never a setting
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def text(self) -> str:
        lo = "(" if self.lo_open else "["
        hi = ")" if self.hi_open or self.hi == INF else "]"
        s = f"{lo}{self.lo:g}, {self.hi:g}{hi}"
        return s + (f"; {self.note}" if self.note else "")


AT_LEAST_1 = Range(1)
AT_LEAST_0 = Range(0)
POSITIVE = Range(0, lo_open=True)
FRACTION = Range(0, 1)  # [0, 1]
SHARE = Range(0, 1, lo_open=True)  # (0, 1]: a share that must not be zero

# field -> range. `*` stands for every element of a list or value of a dict; `[]` for every entry
# of a list of sections. Optional fields are checked only when set (null is their default meaning).
RANGES: dict[str, Range] = {
    "run.seed": Range(0, 2**32 - 1),  # numpy's and torch's seeds
    "run.max_time": POSITIVE,
    "launcher.nproc_per_node": AT_LEAST_1,
    "launcher.threads_per_rank": AT_LEAST_1,
    "model.num_layers": AT_LEAST_1,
    "model.hidden_size": AT_LEAST_1,
    "model.ffn_hidden_size": AT_LEAST_1,
    "model.num_attention_heads": AT_LEAST_1,
    "model.num_query_groups": AT_LEAST_1,
    "model.kv_channels": AT_LEAST_1,
    "model.vocab_size": AT_LEAST_1,
    "model.max_position_embeddings": AT_LEAST_1,
    "model.rope_theta": POSITIVE,
    "model.rope_scaling.factor": POSITIVE,
    "model.rope_scaling.low_freq_factor": POSITIVE,
    "model.rope_scaling.high_freq_factor": POSITIVE,
    "model.rope_scaling.original_max_position_embeddings": AT_LEAST_1,
    "model.rope_scaling.beta_fast": POSITIVE,
    "model.rope_scaling.beta_slow": POSITIVE,
    "model.rope_scaling.mscale": AT_LEAST_0,
    "model.rope_scaling.mscale_all_dim": AT_LEAST_0,
    "model.norm_eps": POSITIVE,
    "model.init_std": AT_LEAST_0,
    "model.num_experts": AT_LEAST_1,
    "model.moe_ffn_hidden_size": AT_LEAST_1,
    "model.moe_router_topk": AT_LEAST_1,
    "model.moe_dense_layers.*": AT_LEAST_0,
    "model.moe_aux_loss_coeff": AT_LEAST_0,
    "model.moe_shared_expert_ffn_hidden_size": AT_LEAST_1,
    "model.moe_router_num_groups": AT_LEAST_1,
    "model.moe_router_group_topk": AT_LEAST_1,
    "model.moe_router_topk_scaling_factor": POSITIVE,
    "model.rotary_percent": SHARE,
    "model.q_lora_rank": AT_LEAST_1,
    "model.kv_lora_rank": AT_LEAST_1,
    "model.qk_nope_head_dim": AT_LEAST_1,
    "model.qk_rope_head_dim": AT_LEAST_1,
    "model.v_head_dim": AT_LEAST_1,
    "model.mtp_layers": AT_LEAST_0,
    "model.fp8_block.*": AT_LEAST_1,
    "parallel.tp": AT_LEAST_1,
    "parallel.pp": AT_LEAST_1,
    "parallel.vp": AT_LEAST_1,
    "parallel.pp_first_stage_layers": AT_LEAST_1,  # the upper bound is model.num_layers - 1:
    "parallel.pp_last_stage_layers": AT_LEAST_1,  # planner/layers.py checks it with the split
    "parallel.cp": AT_LEAST_1,
    "parallel.hierarchical_cp_sizes.*": AT_LEAST_1,
    "parallel.recompute_num_layers": AT_LEAST_1,
    "parallel.ep": AT_LEAST_1,
    "parallel.etp": AT_LEAST_1,
    "moe.capacity_factor": POSITIVE,
    "moe.z_loss_coeff": AT_LEAST_0,
    "moe.aux_loss_coeff": AT_LEAST_0,
    "moe.expert_bias_update_rate": Range(0, note="0 = the published expert bias, never moved"),
    "perf.manual_gc_interval": Range(0, note="0 = one collection, at the start"),
    "train.max_steps": AT_LEAST_1,
    "train.epochs": Range(0, lo_open=True, note="null = train.max_steps decides"),
    "train.global_batch_size": AT_LEAST_1,
    "train.micro_batch_size": AT_LEAST_1,
    "train.grad_clip": Range(0, note="0 = no clipping"),
    "train.skip_bad_steps": AT_LEAST_0,
    "optim.lr": AT_LEAST_0,
    "optim.weight_decay": AT_LEAST_0,
    "optim.betas.*": Range(0, 1, hi_open=True),
    "optim.eps": POSITIVE,
    "sched.warmup_steps": Range(0, note="longer than the run is scaled to train.max_steps"),
    "sched.min_lr": AT_LEAST_0,
    "eval.interval": Range(0, note="0 = off"),
    "eval.iters": AT_LEAST_1,
    "eval.max_samples": AT_LEAST_1,
    "checkpoint.interval": Range(0, note="0 = off"),
    "checkpoint.keep": Range(0, note="0 = keep all"),
    "logger.log_interval": AT_LEAST_1,
    "peft.r": AT_LEAST_1,
    "peft.lora_alpha": POSITIVE,
    "peft.lora_dropout": Range(0, 1, hi_open=True),
    "objective.beta": Range(0, note="grpo: 0 = no KL term, no reference (dpo needs > 0)"),
    "objective.loss_weights.*": AT_LEAST_0,
    "objective.label_smoothing": Range(0, 0.5, hi_open=True, note="0 = off"),
    "objective.num_generations": Range(2, note="groups need two completions to compare"),
    "objective.max_completion_length": AT_LEAST_1,
    "objective.temperature": POSITIVE,
    "objective.top_p": Range(0, 1, lo_open=True, note="1.0 = off"),
    "objective.top_k": Range(0, note="0 = off"),
    "objective.epsilon": Range(0, 1, hi_open=True),
    "objective.epsilon_high": AT_LEAST_0,
    "objective.num_iterations": AT_LEAST_1,
    "objective.rewards[].weight": Range(note="0 = logged only"),
    "precision.first_last_bf16_layers": AT_LEAST_0,
    "precision.fp8_amax_history_len": AT_LEAST_1,
    "precision.fp8_margin": AT_LEAST_0,
    "data.seq_len": Range(2),
    "data.pack_multiple": Range(1),
    "data.val_fraction": Range(0, 1, hi_open=True),
    "data.max_samples": AT_LEAST_1,
    "data.tokenize_workers": AT_LEAST_0,
    "data.mix[].weight": POSITIVE,
    "cluster.num_gpus": AT_LEAST_1,
    "cluster.gpus_per_node": AT_LEAST_1,
    "cluster.gpu_mem_gib": POSITIVE,
    "cluster.compute_capability": POSITIVE,
    "cluster.peak_tflops.*": POSITIVE,
    "cluster.matmul_efficiency": SHARE,
    "cluster.attention_efficiency": SHARE,
    "cluster.hbm_gbps": POSITIVE,
    "cluster.nvlink_domain": AT_LEAST_1,
    "cluster.nvlink_gbps": AT_LEAST_0,
    "cluster.network_gbps": AT_LEAST_0,
    "cluster.reserve_gib": AT_LEAST_0,
    "cluster.step_overhead_s": AT_LEAST_0,
    "cluster.layer_overhead_s": AT_LEAST_0,
    "cluster.sp_layer_overhead_s": AT_LEAST_0,
    "cluster.expert_gemm_half_elems": AT_LEAST_0,
    "cluster.moe_layer_latency_s": AT_LEAST_0,
    "cluster.expert_host_s": AT_LEAST_0,
    "cluster.ep_a2a_hidden": FRACTION,
    "plan.top": AT_LEAST_1,
    "plan.target_fraction": SHARE,
    "plan.headroom": FRACTION,
    "plan.moe_imbalance": Range(1, note="the busiest expert over the mean; 1 = balanced"),
    "export.max_shard_gb": POSITIVE,
    "generate.max_new_tokens": AT_LEAST_1,
    "generate.temperature": Range(0, note="0 = greedy"),
    "generate.top_k": Range(0, note="0 = off"),
    "generate.top_p": Range(0, 1, lo_open=True, note="1.0 = off"),
    "bench.warmup_steps": AT_LEAST_0,
    "bench.measure_steps": AT_LEAST_1,
    "bench.threads": AT_LEAST_1,
    "bench.timeout_min": POSITIVE,
    "bench.repeats": AT_LEAST_1,
    "bench.turns": AT_LEAST_0,
    "bench.loss_tolerance": Range(0, 1, lo_open=True, hi_open=True),
    "bench.gemm_size": AT_LEAST_1,
    "k8s.nodes": AT_LEAST_1,
    "k8s.procs_per_node": AT_LEAST_1,
    "k8s.max_restarts": AT_LEAST_0,
    "k8s.grace_seconds": AT_LEAST_0,
    "k8s.fabric_devices": AT_LEAST_1,
}


# (smaller, larger, strictly): fields whose ranges depend on each other. megatron's scheduler
# asserts min_lr <= max_lr; Llama 3 rope scaling divides by high_freq_factor - low_freq_factor.
ORDER = [
    ("sched.min_lr", "optim.lr", False),
    ("model.rope_scaling.low_freq_factor", "model.rope_scaling.high_freq_factor", True),
]


def _values(node, key: str) -> list[tuple[str, object]]:
    """(full key, value) of each value `key` names under node; none where a section is null."""
    head, _, rest = key.partition(".")
    if node is None:
        return []
    if head == "*":
        items = enumerate(node) if OmegaConf.is_list(node) else node.items()
        return [(str(k), v) for k, v in items]
    if head.endswith("[]"):
        name = head[:-2]
        return [
            (f"{name}[{i}].{k}", v)
            for i, entry in enumerate(node.get(name) or [])
            for k, v in _values(entry, rest)
        ]
    value = node.get(head)
    if not rest:
        return [(head, value)]
    return [(f"{head}.{k}", v) for k, v in _values(value, rest)]


def check_ranges(cfg: DictConfig) -> None:
    """Every numeric field in its range (`RANGES`, then `ORDER`); a wrong type or a value out of
    range is an FtcoreError naming the field."""
    for key, rng in RANGES.items():
        for name, value in _values(cfg, key):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise FtcoreError(f"{value!r} is not a number", field=name,
                                  fix=f"a number in {rng.text()}")  # fmt: skip
            if not rng.holds(float(value)):
                raise FtcoreError(f"{value} is not in {rng.text()}", field=name,
                                  fix=f"{name}=<a value in {rng.text()}>")  # fmt: skip
    for small, large, strict in ORDER:
        a, b = OmegaConf.select(cfg, small), OmegaConf.select(cfg, large)
        if a is None or b is None or (a < b if strict else a <= b):
            continue
        raise FtcoreError(f"{a} must be {'<' if strict else '<='} {large}={b}", field=small,
                          fix=f"lower {small} or raise {large}")  # fmt: skip
