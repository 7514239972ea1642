"""metrics.jsonl (contract in docs/design.md), a progress bar or plain lines, and optional wandb. Rank 0 only."""

from __future__ import annotations

import json
import logging
import math
import resource
import secrets
import sys
import time
from pathlib import Path

import torch

from ftcore.errors import EXIT_REQUEUE, EXIT_USER_ERROR, FtcoreError, StopRequested
from ftcore.runtime import safe_files

log = logging.getLogger("ftcore")


def peak_mem_gib() -> float:
    """Peak device memory on GPU; peak resident memory of this process on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def truncate_metrics(path: Path, step: int) -> None:
    """On resume: drop every line after `step`, so the file reads as one uninterrupted run."""
    if not path.exists():
        return
    kept = []
    for line in safe_files.read_text(path, "run.dir", root=path.parent, limit=1 << 40).splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            break  # a torn last line from a crash
    safe_files.write_atomic(path, "".join(ln + "\n" for ln in kept))


class MetricsWriter:
    def __init__(self, cfg, run_dir: Path, *, enabled: bool, total_steps: int, start_step: int):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.total = total_steps
        self.log_interval = max(1, cfg.logger.log_interval)
        self.wandb = None
        self.bar = None
        m = cfg.model
        # expert_load_max_over_mean at num_experts / top-k: every token went to the same top-k
        # experts in some layer (the router collapsed); said once
        self.collapsed_at = m.num_experts / m.moe_router_topk if m.get("num_experts") else None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.path, start_step)
        self.file = safe_files.open_append(self.path)  # kept open for the run; never a link
        mode = cfg.logger.progress
        if mode == "bar" or (mode == "auto" and sys.stderr.isatty()):
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.bar.add_task("train", total=total_steps, completed=start_step, info="")
            self.bar.start()
        if cfg.logger.wandb.mode != "disabled":
            self._init_wandb(cfg, run_dir, resumed=start_step > 0)

    def _init_wandb(self, cfg, run_dir: Path, *, resumed: bool) -> None:
        """A resumed run continues its wandb run (the id in <run.dir>/wandb_id, which the checkpoint
        restores); a run starting at step 0 is a new wandb run, as its metrics.jsonl starts anew."""
        import wandb
        from omegaconf import OmegaConf

        id_file = run_dir / "wandb_id"
        if resumed and id_file.exists():
            run_id = safe_files.read_text(id_file, "run.dir", root=run_dir, limit=256).strip()
        else:  # our own id (wandb's helper for it moved between versions); 16 hex digits is valid
            run_id = secrets.token_hex(8)
        safe_files.write_atomic(id_file, run_id)
        self.wandb = wandb.init(
            project=cfg.logger.wandb.project,
            mode=cfg.logger.wandb.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            name=f"{cfg.run.exp}/{run_dir.name}",
            config=OmegaConf.to_container(cfg, resolve=True),
        )

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {
            k: (round(v, 8) if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in record.items()
        }
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        step = record["step"]
        if "loss" in record:
            more = objective_fields(record)
            info = f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s{more}"
            if self.bar is not None:
                self.bar.update(self.task, completed=step, info=info)
            elif step % self.log_interval == 0 or step == self.total:
                log.info(
                    "step %d/%d | loss %.4f | grad_norm %.3f | lr %.3e | %.0f tok/s | %.2f s/step%s",
                    step, self.total, record["loss"], record["grad_norm"], record["lr"],
                    record["tokens_per_s"], record["step_time_s"], rollout_fields(record) + more,
                )  # fmt: skip
            self._router_collapse(record)
        else:
            log.info("step %d | eval_loss %.4f", step, record["eval_loss"])

    def _router_collapse(self, record: dict) -> None:
        load = record.get("expert_load_max_over_mean")
        if self.collapsed_at is None or load is None or load < self.collapsed_at * (1 - 1e-6):
            return
        log.warning("step %d: expert_load_max_over_mean %.2f = num_experts / top-k: in some layer "
                    "every token went to the same experts (the router collapsed); lower optim.lr "
                    "or raise moe.aux_loss_coeff (docs/moe.md)", record["step"], load)  # fmt: skip
        self.collapsed_at = None  # said once

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.stop()
        self.file.close()
        if self.wandb is not None:
            # Called from `finally`: a run ending in an exception must not show as finished.
            exc = sys.exc_info()[1]
            codes = {StopRequested: EXIT_REQUEUE, FtcoreError: EXIT_USER_ERROR}
            code = (
                0 if exc is None else next((c for t, c in codes.items() if isinstance(exc, t)), 1)
            )
            self.wandb.finish(exit_code=code)


def objective_fields(record: dict) -> str:
    """What the console step line adds to the loss: DPO's reward accuracy and margin, MoE's
    auxiliary loss and expert load (all in metrics.jsonl too)."""
    out = ""
    if "rewards/accuracies" in record:
        out += f" | acc {record['rewards/accuracies']:.3f} | margin {record['rewards/margins']:.4f}"
    if "aux_loss" in record:
        out += f" | aux_loss {record['aux_loss']:.4g}"
    if "expert_load_max_over_mean" in record:
        out += f" | expert load {record['expert_load_max_over_mean']:.2f}"
    return out


def rollout_fields(record: dict) -> str:
    """objective=grpo's part of the step line: the rollout's seconds and the update's apart, and
    the mean reward on the steps that sampled a rollout."""
    if "rollout_time_s" not in record:
        return ""
    out = f" (rollout {record['rollout_time_s']:.2f} s, update {record['update_time_s']:.2f} s)"
    return out + (f" | reward {record['reward']:.3f}" if "reward" in record else "")


class StepTimer:
    """step_time_s = wall time from the end of the previous step to the end of this one, minus the
    time spent in eval and checkpoint saves (docs/design.md)."""

    def __init__(self):
        self.last = time.perf_counter()
        self.excluded = 0.0

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds

    def lap(self) -> float:
        now = time.perf_counter()
        dt = now - self.last - self.excluded
        self.last, self.excluded = now, 0.0
        return max(dt, 1e-9)


def throughput_fields(cfg, tokens_per_s_per_gpu: float) -> dict:
    """model TFLOP/s per GPU and MFU (against the cluster's dense BF16 peak), from the planner's
    FLOPs-per-token model: 6N' + attention for full training, 4N' for a frozen LoRA base."""
    from ftcore.planner.flops import model_flops_per_token

    tflops = model_flops_per_token(cfg) * tokens_per_s_per_gpu / 1e12
    peak = cfg.cluster.peak_tflops.get("bf16")
    out = {"model_tflops_per_gpu": tflops}
    if peak:
        out["mfu"] = tflops / peak
    return out
