"""`python -m ftcore.eval +exp=NAME [model.hf_path=DIR] [peft.adapter_path=DIR] data.path=FILE
[data.format=text] [eval.output=FILE]`: token-weighted mean next-token cross entropy over a dataset.

Writes `{"loss", "tokens", "ppl"}` (tokens = target tokens), plus `accuracy` (greedy exact match,
ftcore.generate) with `eval.accuracy=true`, to eval.output (default `<run.dir>/eval.json`). Runs under any layout (TP/PP/DP) and launches exactly as train does: under
torchrun/srun, or alone with `launcher.nproc_per_node` local workers. Padded vocab entries are masked
out of the loss (ftcore.training.step), so the number is the model's own.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from pathlib import Path

from omegaconf import DictConfig

from ftcore.cli import run
from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files

log = logging.getLogger("ftcore")


def evaluate(cfg: DictConfig, state=None) -> dict:
    """Every rank: the loss over data.path (or the validation data) with this run's model."""
    from ftcore.training import evaluation, trainer  # lazy: torch stays out of the config errors

    state = state or trainer.setup(cfg, data=False, kind="eval")
    batches = evaluation.held_out_batches(state, path=state.cfg.data.path or None)
    if not batches:
        raise FtcoreError(
            "no evaluation data", field="data.path", fix="point data.path at a JSONL file"
        )
    res = evaluation.evaluate(state, batches)
    if res.tokens == 0:
        raise FtcoreError("the evaluation data has no target tokens", field="data.path",
                          fix="data with answers (or data.format=text, every token a target)")  # fmt: skip
    loss = res.loss
    result = {"loss": loss, "tokens": res.tokens, "ppl": math.exp(min(loss, 700.0))}
    if state.cfg.objective.name == "dpo":  # pairs: the loss and TRL's metrics, means over pairs
        result = {"loss": loss, "pairs": res.pairs, "tokens": res.tokens, **res.metrics}
    if state.cfg.eval.accuracy:  # greedy exact match on the same (instruction/chat) data
        from ftcore.inference.exact_match import exact_match

        acc = exact_match(state, state.cfg.data.path or None, max_samples=cfg.eval.max_samples)
        result["accuracy"] = acc["accuracy"]
    if state.info.rank == 0:
        out = Path(cfg.eval.output) if cfg.eval.output else state.run_dir / "eval.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        safe_files.write_atomic(out, json.dumps(result) + "\n")  # never through a link
        if "pairs" in result:
            log.info("eval: loss %.6f over %d pairs, rewards/accuracies %.4f -> %s", loss,
                     result["pairs"], result["rewards/accuracies"], out)  # fmt: skip
        else:
            log.info("eval: loss %.6f over %d target tokens (ppl %.3f) -> %s", loss,
                     result["tokens"], result["ppl"], out)  # fmt: skip
    return result


def task(cfg: DictConfig) -> int | None:
    from ftcore.precision.decode import decode_safe
    from ftcore.runtime import gpu_env
    from ftcore.validation import checks, preflight

    # FP8/FP4, userbuffers and CUDA graphs cannot run at decode shapes: BF16, none of them
    decode_safe(cfg, say=os.environ.get("RANK", "0") == "0")
    gpu_env.at_process_start(cfg)  # before CUDA/NCCL initialise, whoever started this process
    # first: on a machine without a GPU nothing else matters
    preflight.require_cuda(cfg, "eval")
    preflight.use_adapter(cfg, training=False)  # an adapter path is loaded, never dropped
    if cfg.objective.name == "grpo":
        raise FtcoreError("ftcore.eval has no objective=grpo evaluation yet (held-out rollouts)",
                          field="objective", fix="evaluate the adapter's answers with ftcore.generate, "
                          "or the SFT loss with objective=sft")  # fmt: skip
    from ftcore.runtime import dist as rdist

    status = rdist.launch_standalone(
        cfg, "ftcore.eval", functools.partial(checks.check_for_launch, training=False)
    )
    if status is not None:
        return status
    try:
        evaluate(cfg)
    finally:
        rdist.teardown()
    return None


if __name__ == "__main__":
    run("eval", task)
