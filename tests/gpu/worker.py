"""One GPU test run in its own process (alone or under torchrun): `python -m tests.gpu.worker
MODE OUT overrides...`. Rank 0 writes OUT: a JSON for `train` (per-step losses from metrics.jsonl
and what Transformer Engine's FP8 state says), a tensor file for `logits` (the full-vocabulary
logits of fixed tokens right after loading, before any step), a JSON for `generate` and `eval`
(ftcore.generate's / ftcore.eval's own task: the answer printed, the config it ran with)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def fp8_state(model) -> dict:
    """What TE's modules hold after training: how many ran in FP8, their recipes, and for delayed
    scaling whether the amax histories and scales moved off their initial zeros/ones."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    out = {"te_modules": 0, "fp8_modules": 0, "recipes": [], "amax_nonzero": 0, "scale_changed": 0}
    for chunk in model:
        for m in chunk.modules():
            if not isinstance(m, TransformerEngineBaseModule):
                continue
            out["te_modules"] += 1
            out["fp8_modules"] += int(bool(getattr(m, "fp8", False)))
            recipe = type(m.fp8_meta.get("recipe")).__name__ if m.fp8_meta.get("recipe") else None
            if recipe and recipe not in out["recipes"]:
                out["recipes"].append(recipe)
            st = m.fp8_meta.get("scaling_fwd")
            hist, scale = getattr(st, "amax_history", None), getattr(st, "scale", None)
            out["amax_nonzero"] += int(hist is not None and bool(hist.abs().sum() > 0))
            out["scale_changed"] += int(scale is not None and bool((scale != 1).any()))
    return out


class _JobEnded(Exception):
    pass


def _end_job(state) -> None:
    """After step K's (async) save was started: let it finish and publish, then stop the run."""
    from ftcore.checkpoint import store

    store.wait(state)
    raise _JobEnded


LENGTHS = [60, 20, 33, 7, 90, 41, 12, 25]  # documents of one global batch; FFD packs them in 128


def packed_vs_unpacked(cfg) -> dict:
    """One forward/backward of the same documents: packed into THD rows (micro-batch 1) and one
    document per row (micro-batch 1, padded): loss sums and target counts of each."""
    import numpy as np

    from ftcore.data.packing import first_fit_decreasing, make_microbatch
    from ftcore.data.templates import Doc
    from ftcore.training import trainer

    state = trainer.setup(cfg, data=False)
    r = np.random.default_rng(0)
    vocab, seq = cfg.model.vocab_size, cfg.data.seq_len
    docs = [Doc(r.integers(0, vocab - 1, n).astype(np.int32), r.random(n) < 0.7) for n in LENGTHS]
    packed = [make_microbatch([[docs[i] for i in b]], seq, vocab - 1)
              for b in first_fit_decreasing(LENGTHS, seq)]  # fmt: skip
    unpacked = [make_microbatch([[d]], seq, vocab - 1) for d in docs]
    out = {}
    for name, mbs in (("packed", packed), ("unpacked", unpacked)):
        loss_sum, n = trainer.run_batches(state, mbs, forward_only=True)
        out[name] = {"loss": loss_sum / n, "targets": n, "rows": len(mbs)}
    return out


def adapters_off_losses(cfg) -> dict:
    """Issue 50 item 11 on the GPU: the forward-only loss of fixed documents with every adapter's
    B drawn non-zero: adapted, inside peft.reference.adapters_off, and with every B zeroed."""
    import numpy as np

    from ftcore.data.packing import make_microbatch
    from ftcore.data.templates import Doc
    from ftcore.models.sharding import iter_params
    from ftcore.peft.reference import adapters_off
    from ftcore.training import trainer

    state = trainer.setup(cfg, data=False)
    chunks = [c.module for c in state.model]
    r = np.random.default_rng(0)
    vocab, seq = cfg.model.vocab_size, cfg.data.seq_len
    docs = [Doc(r.integers(0, vocab - 1, n).astype(np.int32), r.random(n) < 0.7) for n in LENGTHS]
    mbs = [make_microbatch([[d]], seq, vocab - 1) for d in docs]
    g = torch.Generator().manual_seed(0)

    def set_b(scale: float) -> None:
        with torch.no_grad():
            for name, p in iter_params(chunks):
                if ".lora_B." in name:
                    p.copy_((torch.randn(p.shape, generator=g) * scale).to(p))

    def loss() -> float:
        loss_sum, n = trainer.run_batches(state, mbs, forward_only=True)
        return loss_sum / n

    set_b(0.5)
    adapted = loss()
    with adapters_off(chunks):
        off = loss()
    set_b(0.0)
    return {"adapted": adapted, "off": off, "base": loss()}


def main(mode: str, out: str, overrides: list[str]) -> None:
    from ftcore.config.schema import compose
    from ftcore.runtime import dist
    from ftcore.training import trainer

    cfg = compose(overrides)
    if os.environ.get("FTCORE_GPU_DETERMINISTIC") == "1":  # bitwise comparisons (resume)
        torch.use_deterministic_algorithms(True)
    try:
        if mode == "train":
            state = trainer.setup(cfg)
            stop_after = int(os.environ.get("FTCORE_GPU_STOP_AFTER", "0"))
            if stop_after:  # end the job there, as a time limit would: the config is unchanged
                state.after_step.append(lambda st: _end_job(st) if st.step == stop_after else None)
            try:
                trainer.fit(state)
            except _JobEnded:
                pass
            if state.info.rank == 0:
                lines = (state.run_dir / "metrics.jsonl").read_text().splitlines()
                losses = [r["loss"] for r in map(json.loads, lines) if "loss" in r]
                from ftcore.precision import recipes

                fp8 = fp8_state(state.model) if recipes.use_te(state.cfg) else None
                Path(out).write_text(json.dumps({"losses": losses, "fp8": fp8}))
        elif mode == "logits":
            state = trainer.setup(cfg, data=False)
            from ftcore.data.pipeline import attention_mask_from_segments

            device = state.info.device
            g = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=g)
            pos = torch.arange(64).unsqueeze(0).expand_as(tokens)
            mask = attention_mask_from_segments(torch.ones_like(tokens, dtype=torch.int32))
            with torch.no_grad():
                logits = state.model[0](tokens.to(device), pos.to(device), mask.to(device))
            if state.info.rank == 0:
                torch.save(logits.float().cpu(), out)
        elif mode == "setup":  # what setup leaves in TE's FP8 state (the stored reference's pass)
            state = trainer.setup(cfg)
            if state.info.rank == 0:
                from ftcore.precision import recipes

                fp8 = fp8_state(state.model) if recipes.use_te(state.cfg) else None
                Path(out).write_text(json.dumps({"fp8": fp8}))
        elif mode == "adapters_off":
            got = adapters_off_losses(cfg)
            if int(os.environ.get("RANK", "0")) == 0:
                Path(out).write_text(json.dumps(got))
        elif mode == "packing":
            Path(out).write_text(json.dumps(packed_vs_unpacked(cfg)))
        elif mode in ("generate", "eval"):  # the entry point's own task, as torchrun runs it
            import contextlib
            import io

            from ftcore import eval as eval_entry
            from ftcore import generate as generate_entry

            if mode == "eval":
                cfg.eval.output = str(Path(out).with_suffix(".eval.json"))
            entry = generate_entry if mode == "generate" else eval_entry
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                entry.task(cfg)
            if int(os.environ.get("RANK", "0")) == 0:
                result = {"text": text.getvalue(), "cfg_precision": cfg.precision.name,
                          "tp_comm_overlap": bool(cfg.parallel.tp_comm_overlap)}  # fmt: skip
                if mode == "eval":
                    result["eval"] = json.loads(Path(cfg.eval.output).read_text())
                Path(out).write_text(json.dumps(result))
        else:
            raise SystemExit(f"unknown mode {mode}")
    finally:
        dist.teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
