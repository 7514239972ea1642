"""setup() builds a run in the one fixed order of docs/design.md; fit() is the training loop."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from omegaconf import DictConfig, OmegaConf

from ftcore.errors import FtcoreError, StopRequested
from ftcore.runtime import collectives, cpu, run_lock, safe_files, signals
from ftcore.runtime import dist as rdist
from ftcore.training import metrics as metrics_mod
from ftcore.training import moe_metrics, objectives, optim, overlap
from ftcore.training.evaluation import evaluate
from ftcore.training.step import is_data_rank, reduce_sums, run_batches  # noqa: F401 (tests call it here)
from ftcore.training.timing import FWD_BWD, GRAD_SYNC, OPTIMIZER, timed

log = logging.getLogger("ftcore")


@dataclass
class TrainState:
    cfg: DictConfig
    info: rdist.DistInfo
    run_dir: Path
    dp: int
    tokenizer: object = None
    model: list = field(default_factory=list)
    optimizer: object = None
    scheduler: object = None
    loader: object = None
    val_batches: list = field(default_factory=list)
    step: int = 0
    consumed_samples: int = 0
    bad_steps: int = 0
    extra: dict = field(default_factory=dict)  # things later stages attach (e.g. wandb id)
    after_step: list = field(default_factory=list)  # fn(state) after each step, outside its time
    timers: object = None  # megatron-style Timers the steps' phases are timed into (timing.py)


def setup(cfg: DictConfig, *, data: bool = True, kind: str = "train") -> TrainState:
    """Build a run. `data=False` leaves state.loader empty (tests feed their own micro-batches).
    `kind` ("train", "eval", "generate"): eval and generate take no held-out split of data.path,
    keep out of the training runs' folder (rdist.decide_run_dir) and write no config.yaml."""
    from ftcore.checkpoint import store
    from ftcore.config.presets import adapt
    from ftcore.data import formats
    from ftcore.data.pipeline import build_train_loader, build_val_batches, set_steps_from_epochs
    from ftcore.data.tokenizer import load_tokenizer
    from ftcore.models import moe_params, moe_routing
    from ftcore.models.builder import build_model, wrap_ddp
    from ftcore.training.optim import build_optimizer, build_scheduler
    from ftcore.validation import checks

    training = kind == "train"
    # 1. HF shapes first, so every check below sees the real model; a preset's evaluation fitted
    #    to the user's data (logged once, by rank 0).
    if cfg.model.hf_path:
        from ftcore.hf.config import merge_hf_config

        cfg = merge_hf_config(cfg)
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))  # before the process group
    formats.resolve(cfg, say=rank == "0", kind=kind)  # data.format=auto: what the records show
    adapt(cfg, training=training, say=rank == "0")
    objective = objectives.of(cfg)  # sft, dpo or grpo: one room each (training/objectives/)
    objective.prepare(cfg)
    # 2. Validate in the pinned order before anything heavy exists.
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    dp = checks.validate(cfg, launched, training=training)  # eval/generate: as checked at launch
    # 3. Process group (gloo on CPU), then the CPU runtime before any megatron module is built.
    info = rdist.init_distributed(cfg)
    if info.device.type == "cpu":
        cpu.activate(hide_cuda=True)  # cluster.device=cpu on a GPU machine too
    # 4. megatron's parallel state (dp is what tp·pp·cp leave) and seeds (CPU + megatron's RNG tracker).
    rdist.init_model_parallel(cfg, info.world)
    if info.device.type == "cuda" and cfg.parallel.tp_comm_overlap:
        from ftcore.runtime import userbuffers

        userbuffers.initialize(cfg)  # TE's TP-overlap buffers, before the model (models/speed.py)
    torch.manual_seed(cfg.run.seed)
    with cpu.device_mode():
        model_parallel_cuda_manual_seed(cfg.run.seed)
    # 5. One run directory for all ranks (written at step 12, once setup has succeeded), locked
    #    for this run: a live run in it already is exit 2 naming its pid, host and start time.
    cfg.run.dir = collectives.broadcast_object(rdist.decide_run_dir(cfg, kind))
    run_dir = Path(cfg.run.dir)
    safe_files.check_run_dir(run_dir)  # no link among its entries: ftcore writes and deletes there
    if training:
        _lock_run_dir(run_dir, info.rank)
    state = TrainState(cfg=cfg, info=info, run_dir=run_dir, dp=dp)
    # 6. Tokenizer (its vocab size is the model's unpadded vocab).
    state.tokenizer = load_tokenizer(cfg)
    if len(state.tokenizer) > cfg.model.vocab_size:
        raise FtcoreError(
            f"the tokenizer has {len(state.tokenizer)} tokens but model.vocab_size={cfg.model.vocab_size}",
            field="model.vocab_size",
            fix="use the model's own tokenizer (model.tokenizer) or a matching model.vocab_size",
        )
    # A chat template that training cannot use is refused here, before the model is built; the
    # one applied is said (generate renders its prompt as an instruction).
    fmt = "instruction" if kind == "generate" else cfg.data.format
    if fmt != "text":
        from ftcore.data.templates import Renderer, describe_template

        Renderer(state.tokenizer, fmt, cfg.data.chat_template, cfg.data.train_on_prompt)
        if info.rank == 0:
            log.info("chat template: %s", describe_template(cfg, state.tokenizer))
    # 7. Model: this rank's chunks, layout-independent init, then HF weights straight into the shards.
    chunks = build_model(cfg)
    moe_routing.install(chunks)  # layout-independent auxiliary losses, expert load (docs/moe.md)
    moe_params.experts_apart(chunks)  # one optimizer layout at every ep (resume across ep)
    if cfg.model.hf_path or cfg.model.init_path:
        from ftcore.hf.io import load_weights

        load_weights(cfg, chunks)
    moe_routing.remember_bias(chunks)  # expert_bias_shift is measured from here (docs/deepseek.md)
    # 8. PEFT adapters (freezes the base) before DDP, so only adapters get grad buffers.
    if cfg.peft.name != "none":
        from ftcore.peft.lora import apply_peft

        apply_peft(cfg, chunks, say=training)  # the trainable-parameter count, when training
    objective.build(state, chunks, training=training, data=data)  # a reference, reward functions
    state.extra["objective"] = objective
    # 9. Data: this DP rank's shard of a layout-independent global order. Before the schedule:
    #    with train.epochs, the step count comes from the data size.
    dp_rank = ps.get_data_parallel_rank()
    if data:
        state.loader = objective.loader(state, dp_rank, dp)
        if state.loader is None:  # the data pipeline's stream of rows
            state.loader = build_train_loader(cfg, state.tokenizer, dp_rank, dp)
            set_steps_from_epochs(cfg, state.loader.report["rows"], state.loader)
        if cfg.eval.interval > 0:
            state.val_batches = build_val_batches(cfg, state.tokenizer, dp_rank, dp)
    # 10. megatron DDP, optimizer over trainable params, LR schedule.
    state.model = wrap_ddp(cfg, chunks)
    state.optimizer = build_optimizer(cfg, state.model)
    state.scheduler = build_scheduler(cfg, state.optimizer)
    _wire_model_config(state)
    objective.before_resume(state, training=training, data=data)  # dpo: precompute_ref's pass
    # 11. Resume (model, optimizer, schedule, data position, RNG) from checkpoints/latest: its
    #     refusals (another model, PEFT mode, data position) come before anything is written.
    #     (Stop-request handlers are installed by fit(), for exactly as long as it checks them.)
    store.maybe_resume(state)
    objective.after_resume(state, training=training, data=data)  # dpo: precompute_ref's file
    # 12. The run directory and its config.yaml, only now: a run that fails above writes nothing.
    #     generate writes nothing at all (its output is the text); eval its eval.json later.
    if info.rank == 0 and kind == "train":
        run_dir.mkdir(parents=True, exist_ok=True)  # resolved: what ftcore writes holds no ${...}
        safe_files.write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        log.info("run directory: %s", run_dir)
    return state


def _lock_run_dir(run_dir: Path, rank: int) -> None:
    """Collective: rank 0 locks `run_dir` for this run (runtime/run_lock.py) unless this process
    or its launcher holds the lock already; a refusal is raised on every rank, so that they all
    exit 2 with the same line."""
    refused = None
    if rank == 0 and not run_lock.held(run_dir):
        run_lock.release()  # an earlier run's, in this process (tests build several in one)
        try:
            run_lock.acquire(run_dir)
        except FtcoreError as e:
            refused = (e.args[0].split(" -- fix: ")[0], e.fix)
    refused = collectives.broadcast_object(refused)
    if refused is not None:
        message, fix = refused
        raise FtcoreError(message, fix=fix)


def _wire_model_config(state: TrainState) -> None:
    """The hooks megatron's schedule calls: grad finalisation (DP/SP/embedding reductions) etc."""
    config = state.model[0].config
    config.finalize_model_grads_func = _finalize_grads
    config.grad_scale_func = state.optimizer.scale_loss
    no_sync = [m.no_sync for m in state.model]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    overlap.wire(config, state.model, state.cfg)  # overlapped grad reduce / param gather


def _finalize_grads(model: list, *args, **kwargs) -> None:
    """megatron's finalize_model_grads, timed as GRAD_SYNC when the step is timed (the schedule
    calls it with the model config's timers set: step.run_batches)."""
    with timed(model[0].config.timers, GRAD_SYNC):
        finalize_model_grads(model, *args, **kwargs)


def train_step(state: TrainState) -> dict:
    """One optimizer step; its phases are timed into state.timers when set (timing.py)."""
    cfg, timers = state.cfg, state.timers
    objective = state.extra["objective"]
    microbatches, times = objective.batch(state, timers)  # grpo: a rollout when one is due
    t_update = time.perf_counter()
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    moe = moe_metrics.is_moe(state.model)
    with timed(timers, FWD_BWD):  # the loss: its own and TRL's metrics (dpo, grpo)
        res = objective.run(state, microbatches, forward_only=False, timers=timers)
    loss, target_tokens, metrics = res.loss, res.tokens, dict(res.metrics)
    if moe:
        metrics.update(moe_metrics.collect(state))  # aux_loss, expert load (docs/moe.md)
    if not math.isfinite(loss):
        return {
            "loss": loss,
            "grad_norm": float("nan"),
            "skipped": True,
            "target_tokens": target_tokens,
        }
    with cpu.device_mode(), timed(timers, OPTIMIZER):
        # Non-finite grads must be caught before the update: without loss scaling megatron's step
        # applies them (clipping skips a NaN norm), poisoning the weights a skip should protect.
        found_inf = state.optimizer.prepare_grads()
        norm = float("nan") if found_inf else optim.grad_norm(state.optimizer)
        # this step's lr: step k applies the schedule at k (optim.build_scheduler), so the first
        # step of a warm-up trains, and the lr the step line logs is the one this update used
        state.scheduler.step(increment=1)
        if not math.isfinite(norm) or not optim.step_with_norm(state.optimizer, norm):
            state.scheduler.step(increment=-1)  # a skipped step takes no step of the schedule
            return {
                "loss": loss,
                "grad_norm": norm,
                "skipped": True,
                "target_tokens": target_tokens,
            }
    (tokens,) = reduce_sums([float(sum(mb.num_tokens for mb in microbatches))], is_data_rank())
    state.consumed_samples += cfg.train.global_batch_size
    if "update_time_s" in times:  # grpo: the rollout and the update apart (the step line)
        times["update_time_s"] += time.perf_counter() - t_update
    return {
        "loss": loss,
        "grad_norm": norm,
        "tokens": int(tokens),
        "target_tokens": int(target_tokens),
        "metrics": {**times, **metrics},
    }


def _handle_bad_step(state: TrainState, out: dict) -> None:
    state.bad_steps += 1
    msg = f"non-finite loss or grad norm at step {state.step + 1} (loss={out['loss']}, grad_norm={out['grad_norm']})"
    if state.bad_steps > state.cfg.train.skip_bad_steps:
        raise FtcoreError(
            msg + "; stopped without saving this state",
            field="train",
            fix="lower optim.lr, check the data, or allow skips with train.skip_bad_steps=K",
        )
    log.warning(
        "%s: step skipped (%d/%d allowed)", msg, state.bad_steps, state.cfg.train.skip_bad_steps
    )


def fit(state: TrainState) -> None:
    from ftcore.checkpoint import store

    cfg = state.cfg
    rank0 = state.info.rank == 0
    writer = metrics_mod.MetricsWriter(
        cfg, state.run_dir, enabled=rank0, total_steps=cfg.train.max_steps, start_step=state.step
    )
    if state.step == 0 and rank0:
        log.info("training %d steps (dp=%d, %d micro-batches/step/rank)", cfg.train.max_steps, state.dp,
                 cfg.train.global_batch_size // (cfg.train.micro_batch_size * state.dp))  # fmt: skip
    if cfg.eval.accuracy and state.step == 0:  # held-out exact match of the starting model
        from ftcore.inference.exact_match import accuracy

        state.extra["accuracy_before"] = accuracy(state, "before fine-tuning")
    timer = metrics_mod.StepTimer()
    start_time = time.time()
    world = state.info.world
    signals.install(cfg)
    collector = overlap.Collector(cfg).__enter__()  # perf.manual_gc
    try:
        while state.step < cfg.train.max_steps:
            out = train_step(state)
            if out.get("skipped"):
                _handle_bad_step(state, out)
                continue
            state.step += 1
            dt = timer.lap()
            record = {
                "step": state.step,
                "loss": out["loss"],
                "lr": state.optimizer.param_groups[0]["lr"],
                "grad_norm": out["grad_norm"],
                "tokens": out["tokens"],
                "target_tokens": out["target_tokens"],
                "tokens_per_s": out["tokens"] / dt,
                "tokens_per_s_per_gpu": out["tokens"] / dt / world,
                "step_time_s": dt,
                "peak_mem_gib": metrics_mod.peak_mem_gib(),
            }
            record.update(metrics_mod.throughput_fields(cfg, record["tokens_per_s_per_gpu"]))
            record.update(out["metrics"])  # dpo: rewards/*, logps/*; MoE: aux_loss, expert load
            writer.write(record)
            state.extra["last_loss"] = out["loss"]
            t0 = time.perf_counter()
            collector.step(state.step)
            if cfg.eval.interval and state.step % cfg.eval.interval == 0 and state.val_batches:
                _evaluate(state, writer)
            store.poll(state)  # publish a finished background save (GPU)
            if cfg.checkpoint.interval and state.step % cfg.checkpoint.interval == 0:
                store.save(state)
            reason = signals.stop_reason(cfg, state.run_dir, start_time)
            if reason and state.step < cfg.train.max_steps:
                store.save(state, blocking=True)  # a no-op if this step's is already published
                signals.consume(cfg, state.run_dir, state.info.rank)
                raise StopRequested(state.step, reason, signals.resume_command(cfg))
            for hook in state.after_step:  # the benchmark's turn-taking (ftcore.bench.turns)
                hook(state)
            timer.exclude(time.perf_counter() - t0)
        evaluated = [s for s, _ in state.extra.get("eval_losses", [])]
        if (
            state.val_batches and state.step not in evaluated
        ):  # a run shorter than eval.interval too
            _evaluate(state, writer)
        finish(state)
    finally:
        collector.__exit__()
        writer.close()
        signals.uninstall()


def _evaluate(state: TrainState, writer) -> None:
    """The validation loss now: a metrics.jsonl line, and the end summary's."""
    res = evaluate(state, state.val_batches[: state.cfg.eval.iters])
    val = res.loss
    extra = {f"eval_{k}": v for k, v in res.metrics.items()}  # dpo: TRL's eval_rewards/... names
    writer.write({"step": state.step, "eval_loss": val, **extra})
    state.extra.setdefault("eval_losses", []).append((state.step, val))


def finish(state: TrainState) -> None:
    """End of a run: a last checkpoint, then the Hugging Face artefacts (hf_adapter/ or hf_model/)."""
    from ftcore.checkpoint import store
    from ftcore.models.builder import params_current

    cfg = state.cfg
    params_current(state.model)  # the last update, before anything reads the weights
    if cfg.checkpoint.save_at_end and not store.exists(state, state.step):
        store.save(state)
    store.wait(state)
    if cfg.eval.accuracy:
        from ftcore.inference.exact_match import accuracy

        accuracy(state, "after fine-tuning", before=state.extra.get("accuracy_before"))
    if cfg.peft.name != "none":
        from ftcore.peft.adapter_format import write_hf_adapter

        out = write_hf_adapter(state)
    else:
        from ftcore.hf.export import write_hf_model

        out = write_hf_model(state)
    if state.info.rank == 0:
        from ftcore.training.summary import summary

        for line in summary(state, out):
            log.info("%s", line)
