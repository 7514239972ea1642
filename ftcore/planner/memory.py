"""Bytes per GPU of one pipeline rank: weights, gradients, optimizer state, activations, reserve.

Model state is replayed the way megatron allocates it, so it is exact on CPU:
- trainable parameters live in megatron DDP's contiguous buffers, one per model chunk: with the
  distributed optimizer every parameter starts at a multiple of 64 elements and the buffer is padded
  to a multiple of lcm(dp*cp, 128); parameters and fp32 gradients both use that padded size;
- the distributed optimizer gives rank i elements [i*n/dp, (i+1)*n/dp) of the buffer and keeps fp32
  main params (bf16 models only; fp32 models use views) and Adam's two moments for the parameter
  elements inside that range; without it every rank keeps them for all trainable elements;
- expert parameters (MoE; params.py) fill a second buffer per chunk, reduced and, with the
  distributed optimizer, sharded over the expert data-parallel group: world / (pp * ep * etp)
  ranks (tp * dp * cp / (ep * etp)), which holds the same experts;
- frozen parameters (LoRA's base) keep their own storage and have no gradient or optimizer state;
- FP8/FP4 (GPU): TE caches the quantized weights between micro-batches (data, plus a transposed
  copy on Hopper where FP8 GEMMs need the TN layout); with `precision.fp8_param_gather` the weights
  are stored quantized instead of in bf16. QLoRA keeps frozen linears in NF4.

Loading has its own peak, before any gradient, optimizer state or activation exists (`load`): what
the loaded weights occupy plus the one full-precision shard the loader assembles whole before
handing it over (QLoRA's NF4 quantizer, or a quantized FP8/FP4 parameter's single `copy_`; see
hf/io.py). A QLoRA base drawn at random (no model.hf_path/init_path) is built in full precision and
quantized afterwards, so there it is the whole full-precision base. A stage's total is the larger
of its training and its load peak (plus the reserve).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from ftcore.planner import activations as act
from ftcore.planner import buffers, calibration, cp, grpo, userbuffers
from ftcore.planner.layers import split_for
from ftcore.planner.params import (
    chunk_runs,
    init_method,
    linear_shapes,
    padded_vocab,
    rank_params,
    run_params,
)
from ftcore.planner.view import shared_cache, view


def margin(cfg, stage) -> float:
    """Bytes `fits` keeps free on a stage: plan.headroom of its activations, the estimated term
    (the model state is exact; activations are within 10% of measured on CPU, assumed on GPU)."""
    plan = getattr(cfg, "plan", None)
    return float(getattr(plan, "headroom", 0.0) or 0.0) * stage.activations


def fits(cfg, stage, cap: float) -> bool:
    return stage.total + margin(cfg, stage) <= cap


GiB = 1024**3
GRAD_REDUCE_IN_FP32 = (
    True  # the default (perf.grad_reduce_dtype=fp32); grad_bytes() reads the config
)


def grad_bytes(cfg: DictConfig) -> int:
    """Bytes per element of megatron's grad buffers (models/speed.py: perf.grad_reduce_dtype)."""
    dtype = getattr(getattr(cfg, "perf", None), "grad_reduce_dtype", "fp32")
    return 4 if dtype == "fp32" else act.DTYPE_BYTES[cfg.precision.params_dtype]


@dataclass
class StageMemory:
    pp_rank: int
    layers: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    reserve: int
    load: int = 0  # peak while loading the weights (no grads/optimizer/activations yet)
    parts: dict = field(default_factory=dict)  # finer terms (bytes) for the table and the tests

    @property
    def training(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def total(self) -> int:
        return max(self.training, self.load) + self.reserve

    def largest(self) -> tuple[str, int]:
        if self.load > self.training:
            return "load peak", self.load
        terms = {k: getattr(self, k) for k in ("weights", "grads", "optimizer", "activations")}
        return max(terms.items(), key=lambda kv: kv[1])


def quantized_weight_bytes(cfg: DictConfig) -> float:
    """Bytes per element TE keeps for a quantized linear weight (0 when not quantized)."""
    pr, c = cfg.precision, cfg.cluster
    if c.device == "cpu" or not (pr.fp8_recipe or pr.fp4_recipe):
        return 0.0
    hopper = (c.compute_capability or 9.0) < 10.0
    if pr.fp4_recipe:  # NVFP4: 4-bit data + an FP8 scale per 16, row- and column-wise
        return 2 * (0.5 + 1 / 16)
    recipe = pr.fp8_recipe
    if recipe == "mxfp8":  # E8M0 scale per 32, row- and column-wise copies
        return 2 * (1 + 1 / 32)
    if recipe == "blockwise":  # fp32 scale per 128 (1x128 / 128x128), both orientations
        return 2 * (1 + 4 / 128)
    return 2.0 if hopper else 1.0  # per-tensor scaling: transpose cache only where GEMMs need TN


def nf4_bytes(double_quant: bool, block: int = 64) -> float:
    """bitsandbytes NF4: 4 bits per value + an absmax per 64 (fp32, or 8-bit + fp32 per 256 blocks)."""
    return 0.5 + (1 / block + 4 / (block * 256) if double_quant else 4 / block)


def expert_dp(cfg, dp: int) -> int:
    """The expert data-parallel size for a dense dp*cp of `dp`: world / (pp * ep * etp)."""
    p = cfg.parallel
    return max(dp * p.tp // ((getattr(p, "ep", 1) or 1) * (getattr(p, "etp", 1) or 1)), 1)


def model_state(cfg: DictConfig, pp_rank: int, dp: int, dp_rank: int = 0) -> dict[str, int]:
    """Weights, grads and optimizer bytes of one rank; `dp` counts dp*cp (megatron's dp_cp group;
    expert parameters use expert_dp of it)."""
    cfg = view(cfg)
    p = cfg.parallel
    # everything of the layout it reads (not recompute, the micro batch, sp or the CP exchange):
    # the search's candidates that differ only in those share it
    key = ("model_state", p.tp, p.pp, p.vp, getattr(p, "ep", 1), getattr(p, "etp", 1),
           p.distributed_optimizer, pp_rank, dp, dp_rank)  # fmt: skip
    cache = shared_cache(cfg)
    if key not in cache:
        cache[key] = _model_state(cfg, pp_rank, dp, dp_rank)
    return dict(cache[key])


def _model_state(cfg, pp_rank: int, dp: int, dp_rank: int) -> dict[str, int]:
    out: dict[str, int] = {}
    lif_sum = lif_max = 0
    for vp_stage in range(cfg.parallel.vp):
        chunk = _chunk_state(cfg, chunk_runs(cfg, pp_rank, vp_stage), dp, dp_rank)
        for k, v in chunk.items():
            if not k.startswith("lif_"):
                out[k] = out.get(k, 0) + v
        lif_sum, lif_max = lif_sum + chunk["lif_sum"], max(lif_max, chunk["lif_max"])
    out["load_in_flight"] = max(lif_sum, lif_max)
    pb = act.DTYPE_BYTES[cfg.precision.params_dtype]
    out["reference"] = 0
    if (act.reference_forwards(cfg) or grpo.frozen_reference(cfg)) and cfg.peft.name == "none":
        # full fine-tuning DPO: a frozen copy of the starting weights, sharded like the policy
        # (training/objectives/dpo/); LoRA's reference is the same model with its adapters off
        out["reference"] = out["elements"] * pb
    out["weights"] = out["frozen"] + out["trainable"] + out["quantized_cache"] + out["reference"]
    return out


def _chunk_state(cfg, runs: tuple, dp: int, dp_rank: int) -> dict[str, int]:
    """One model chunk's bytes (its own DDP buffers), the same for every chunk of the same runs:
    memoised across pipeline ranks and the search's layouts."""
    p = cfg.parallel
    key = ("chunk", p.tp, getattr(p, "ep", 1), getattr(p, "etp", 1), p.distributed_optimizer,
           dp, dp_rank, runs)  # fmt: skip
    cache = shared_cache(cfg)
    if key not in cache:
        cache[key] = _chunk_bytes(cfg, runs, dp, dp_rank)
    return cache[key]


def _run_params(cfg, run) -> list[tuple]:
    p = cfg.parallel
    key = ("run", p.tp, getattr(p, "ep", 1), getattr(p, "etp", 1), run.what)
    cache = shared_cache(cfg)
    if key not in cache:
        cache[key] = run_params(cfg, run)
    return cache[key]


def _chunk_bytes(cfg, runs: tuple, dp: int, dp_rank: int) -> dict[str, int]:
    pr = cfg.precision
    pb = act.DTYPE_BYTES[pr.params_dtype]
    gb = grad_bytes(cfg)
    qbytes = quantized_weight_bytes(cfg)
    param_gather = qbytes > 0 and bool(pr.fp8_param_gather)
    qlora = cfg.peft.name == "qlora"
    loaded = bool(cfg.model.hf_path or cfg.model.init_path)
    on_cpu = cfg.cluster.device == "cpu"
    out = dict(grads=0, optimizer=0, frozen=0, trainable=0, quantized_cache=0, elements=0,
               load_resident=0, lif_sum=0, lif_max=0, expert_grads=0, expert_trainable=0)  # fmt: skip
    blocks = [(_run_params(cfg, run), run.count, run.quantized) for run in runs]
    for params, k, quantized in blocks:  # k identical layers (or one non-layer parameter)
        for _, numel, trainable, kind, _ in params:
            out["elements"] += k * numel
            quant = bool(qbytes) and kind == "linear" and quantized
            if quant:
                per = qbytes - 1 if trainable and param_gather else qbytes
                out["quantized_cache"] += k * int(numel * per)  # param_gather: no bf16 copy
            if not trainable:
                if qlora and kind == "linear":
                    nbytes = int(numel * nf4_bytes(cfg.peft.double_quant))
                elif quant and param_gather:
                    nbytes = 0  # counted in quantized_cache
                else:
                    nbytes = numel * pb
                out["frozen"] += k * nbytes
                out["load_resident"] += k * nbytes
                if qlora and kind == "linear":  # the full-precision shard quantized as read:
                    if loaded:  # one at a time
                        out["lif_max"] = max(out["lif_max"], numel * pb)
                    else:  # a random base is built whole first, then quantized
                        out["lif_sum"] += k * numel * pb
            elif kind != "lora":  # adapters are created after the load
                out["load_resident"] += k * numel * (qbytes if quant and param_gather else pb)
            if quant and param_gather:  # assembled in high precision, written with one copy_
                out["lif_max"] = max(out["lif_max"], numel * pb)
    for expert in (False, True):
        group = [([q[1] for q in ps if q[2] and q[4] == expert], k) for ps, k, _ in blocks]
        if any(n for n, _ in group):
            gdp = expert_dp(cfg, dp) if expert else dp
            _buffer_state(out, group, expert, gdp, dp_rank % gdp, cfg, pb, gb, param_gather,
                          on_cpu)  # fmt: skip
    return out


def _buffer_state(out, blocks, expert, dp, dp_rank, cfg, pb, gb, param_gather, on_cpu) -> None:
    """Add one DDP buffer's trainable weights, gradients and optimizer state to `out`; `blocks`:
    (element counts of one copy's trainable parameters, copies), in registration order."""
    p = cfg.parallel
    runs, size = buffers.layout(blocks, p.distributed_optimizer, dp)
    numel = sum(k * sum(n) for n, k in blocks)
    tb = 1 if param_gather else pb
    weights = (size if p.distributed_optimizer else numel) * tb
    out["trainable"] += weights
    out["grads"] += size * gb
    if expert:
        out["expert_trainable"] += weights
        out["expert_grads"] += size * gb
    if p.distributed_optimizer:
        elems, tensors = buffers.shard(runs, size, dp, dp_rank)
    else:
        elems, tensors = numel, sum(k * len(n) for n, k in blocks)
    main = 4 if (pb != 4 or param_gather) else 0  # fp32 master copy of bf16/fp8 weights
    out["optimizer"] += elems * (main + 8) + (tensors * 4 if on_cpu else 0)  # + torch Adam's step


def stage_memory(
    cfg: DictConfig, world: int, pp_rank: int, micro_batch: int | None = None
) -> StageMemory:
    cfg = view(cfg)
    p, t = cfg.parallel, cfg.train
    dp = world // (p.tp * p.pp * p.cp)
    mbs = micro_batch or t.micro_batch_size
    num_micro = max(1, t.global_batch_size // (mbs * max(dp, 1)))
    state = model_state(cfg, pp_rank, max(dp, 1) * p.cp)
    sh = act.shape_of(cfg, mbs)
    layer = act.layer_bytes(sh)
    layer_mb, inputs = act.in_flight_layers(cfg, pp_rank, num_micro)
    last = pp_rank == p.pp - 1
    split = split_for(cfg)
    holds_last_layer = last and split[pp_rank][-1] > 0
    saved = layer * layer_mb - (act.last_layer_saving(sh) if holds_last_layer else 0)
    loss = sum(act.loss_bytes(sh).values()) if last else 0
    # The schedule keeps each in-flight micro-batch's stage input; the first layer saves that same
    # tensor (TE's norm, the recompute checkpoint, fp32 norms) except ftcore's RMSNorm on a bf16
    # input, which saves an fp32 copy. On CPU outputs are not deallocated: they stay too.
    boundary = sh.tokens * sh.hs * sh.ab
    pipe = 0
    if sh.impl == "local":
        received = inputs - (1 if pp_rank == 0 and inputs else 0)
        pipe = boundary * (received if sh.ab != 4 and sh.recompute != "full" else 0)
        pipe += boundary * (inputs - (1 if last and inputs else 0))
    # The boolean [b, 1, s/cp, s] causal/segment mask of each in-flight micro-batch (local
    # attention: a CP rank's query rows against every key).
    mask = sh.b * sh.sl * sh.s * max(inputs, 1) if sh.impl == "local" else 0
    # The loss (forward) and a recomputed layer with its CP attention's buffers (backward) peak
    # at different times.
    logits = act.logits_transient(sh) if last else 0
    recompute = act.recompute_transient(sh)
    cp_buffers = cp.transient_bytes(sh)
    activations = saved + pipe + mask + max(loss + logits, recompute + cp_buffers)
    rollout = grpo.rollout_bytes(cfg, world, pp_rank)  # objective=grpo: KV cache, between updates
    activations = max(activations, rollout)
    return StageMemory(
        pp_rank=pp_rank,
        layers=sum(split[pp_rank]),
        weights=state["weights"],
        grads=state["grads"],
        optimizer=state["optimizer"],
        activations=activations,
        # the allowance, and TE's userbuffers where parallel.tp_comm_overlap allocates them
        reserve=int(calibration.of(cfg.cluster).reserve_gib * GiB) + userbuffers.buffer_bytes(cfg),
        load=state["load_resident"] + state["load_in_flight"],
        parts=dict(
            load_resident=state["load_resident"],
            load_shard_in_flight=state["load_in_flight"],
            frozen_weights=state["frozen"],
            trainable_weights=state["trainable"],
            quantized_weights=state["quantized_cache"],
            reference_weights=state["reference"],
            layer_activation=layer,
            layers_in_flight=layer_mb,
            saved_activations=saved,
            loss_activations=loss,
            pipeline_buffers=pipe,
            masks=mask,
            logits_transient=logits,
            recompute_transient=recompute,
            cp_transient=cp_buffers,
            rollout_transient=rollout,
            elements=state["elements"],
            userbuffers=userbuffers.buffer_bytes(cfg),
        ),
    )


def all_stages(cfg: DictConfig, world: int, micro_batch: int | None = None) -> list[StageMemory]:
    cfg = view(cfg)
    return [stage_memory(cfg, world, r, micro_batch) for r in range(cfg.parallel.pp)]


def host_bytes(cfg: DictConfig, world: int, pp_rank: int) -> dict[str, int]:
    """Host (CPU) memory one rank of a pipeline stage needs beyond its process itself, by phase:
    - init: a random base drawn layout-independently holds each full fp32 tensor on the CPU (the
      largest; the vocab's twice: the real rows and the padded copy). A sharded init
      (models/init.py) draws on the GPU and a loaded base (hf_path/init_path) is not drawn: 0.
    - checkpoint: an async save (GPU) stages what the rank saves in host memory: its trainable
      weights and optimizer state (with PEFT only the adapters are saved).
    FP8/FP4 weights leave no high-precision copy on the host (models/builder.py drops each as it
    is made: one weight's at a time), so neither term grows with a frozen base."""
    cfg = view(cfg)
    m, p = cfg.model, cfg.parallel
    on_gpu = cfg.cluster.device != "cpu"
    init = 0
    if not (m.hf_path or m.init_path) and init_method(cfg, on_gpu=on_gpu) == "layout_independent":
        kinds = {q.kind for chunk in rank_params(cfg, pp_rank) for q in chunk}
        largest = max(o * i for o, i in linear_shapes(m, 1).values()) if "linear" in kinds else 0
        if kinds & {"embedding", "output"}:
            largest = max(
                largest, (m.vocab_size + padded_vocab(m.vocab_size, p.tp)) * m.hidden_size
            )
        init = 4 * largest
    checkpoint = 0
    if on_gpu and cfg.checkpoint.async_save:
        dp = max(world // (p.tp * p.pp * p.cp), 1)
        state = model_state(cfg, pp_rank, dp * p.cp)
        checkpoint = state["trainable"] + state["optimizer"]
    return {"init": init, "checkpoint": checkpoint, "peak": max(init, checkpoint)}
