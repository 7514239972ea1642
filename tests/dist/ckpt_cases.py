"""Worker-side helpers for the checkpoint/resume tests (run inside the gloo pool)."""

from __future__ import annotations

import torch

from ftcore import checkpoint, trainer
from ftcore.models.sharding import iter_params
from tests.dist.layouts import build


def build_resumed(overrides: list[str], run_dir: str, resume: str = "auto"):
    """A run with the synthetic loader attached *before* resuming, as the trainer's own loader is
    (layouts.build attaches it after setup, which would leave the data position unrestored)."""
    state = build(list(overrides) + ["checkpoint.resume=never"], run_dir)
    state.cfg.checkpoint.resume = resume
    checkpoint.maybe_resume(state)
    return state


def train(state, steps: int, save_every: int = 0) -> list[float]:
    losses = []
    for _ in range(steps):
        out = trainer.train_step(state)
        assert not out.get("skipped")
        state.step += 1
        losses.append(out["loss"])
        if save_every and state.step % save_every == 0:
            checkpoint.save(state)
    return losses


def local_tensors(state) -> dict[str, torch.Tensor]:
    """This rank's parameter shards and their Adam moments (same layout: shards compare 1:1)."""
    out = {}
    opt = state.optimizer
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    for name, p in iter_params(state.model):
        out[name] = p.detach().clone()
        for o in inner:
            for k, v in o.state.get(p, {}).items():
                out[f"{name}/{k}"] = torch.as_tensor(v).clone()
    return out
