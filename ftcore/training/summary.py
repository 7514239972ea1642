"""The end-of-run lines: what was trained, how it went, where everything is, and the command that
generates with the result, carrying the run's own overrides so that it runs when pasted."""

from __future__ import annotations

import shlex
from pathlib import Path

# Overrides a generate command leaves out: what only training reads (its data, steps, optimizer,
# schedule, evaluation, checkpoints, logging), where this run wrote, and the objective (a DPO
# reference is not needed to generate). Everything else (model, peft, precision, cluster,
# launcher, parallel, moe, data.seq_len, data.chat_template, ...) is kept: the model is built the same.
_TRAINING_ONLY = ("train.", "optim.", "sched.", "eval.", "checkpoint.", "logger.", "objective",
                  "run.dir", "run.max_time", "run.stop_file", "run.id", "run.handle_signals",
                  "peft.adapter_path", "export.", "plan.", "bench", "k8s.")  # fmt: skip
_DATA_KEPT = ("data.seq_len", "data.chat_template")


def override_key(override: str) -> str:
    """`+exp=x` -> `exp`, `~data.path` -> `data.path`, `cluster=local_cpu` -> `cluster`."""
    return override.lstrip("+~").split("=", 1)[0]


def generate_command(cfg, hf_out: Path) -> str:
    """`python -m ftcore.generate` for what this run wrote, with the run's overrides that build
    the model (a run with model.hf_path=DIR cluster=local_cpu generates with them too)."""
    lora = cfg.peft.name != "none"
    replaced = ("peft.adapter_path",) if lora else ("model.hf_path", "model.init_path")
    kept = []
    for o in cfg.run.overrides:
        key = override_key(o)
        if key.startswith(_TRAINING_ONLY) or key in replaced:
            continue
        if key.startswith("data.") and key not in _DATA_KEPT:
            continue
        kept.append(o)
    for key in ("cp", "vp"):  # generation runs at any layout but these (checkpoints load at any)
        if cfg.parallel[key] > 1:
            kept.append(f"parallel.{key}=1")
    use = f"peft.adapter_path={hf_out}" if lora else f"model.hf_path={hf_out}"
    return (
        shlex.join(["python", "-m", "ftcore.generate", *kept, use]) + " 'generate.prompt=\"...\"'"
    )


def summary(state, hf_out: Path | None) -> list[str]:
    cfg, run_dir = state.cfg, state.run_dir
    lines = [f"done: {state.step} steps; run directory {run_dir}"]
    if "last_loss" in state.extra:
        lines.append(f"  final training loss {state.extra['last_loss']:.4f}")
    evals = state.extra.get("eval_losses", [])
    if evals:
        best_step, best = min(evals, key=lambda e: e[1])
        lines.append(
            f"  validation loss: final {evals[-1][1]:.4f}, best {best:.4f} (step {best_step})"
        )
    ckpt = run_dir / "checkpoints"
    if ckpt.is_dir():
        lines.append(f"  checkpoints: {ckpt}")
    if hf_out is not None:
        lora = cfg.peft.name != "none"
        lines.append(f"  {'adapter (PEFT)' if lora else 'model (HF)'}: {hf_out}")
        lines.append(f"  generate with: {generate_command(cfg, hf_out)}")
    return lines
