"""No unintended host sync in a steady-state training step on one GPU (issue 24, finding 6).

A host sync (`.item()`, `float(t)`, `.tolist()` of a CUDA tensor, a blocking copy to or from the
GPU, `nonzero` on the GPU, ...) makes the host wait until the GPU has drained its queue; inside
the micro-batch loop that stalls the pipeline schedule once per micro-batch (per layer, for the
unfused packed RoPE). Each case trains a tiny model a few steps, then runs STEPS more under
`torch.cuda.set_sync_debug_mode("warn")`, recording the Python stack of every sync CUDA reports.
A sync is attributed to the innermost ftcore function on its stack; the intended ones are:

- `ftcore/training/step.py:loss_sums`: the step's loss and target-token sums, read once per step (logging,
  and the host decides to skip a non-finite step);
- `ftcore/training/step.py:reduce_sums`: the all-reduced sums back on the host, a few per step;
- `ftcore/training/optim.py:*`: gradient norm, clipping and the update decision (found-inf), once per step
  (megatron's own optimizer code reads the norm too).

Anything else fails the test with its stacks, and so does any sync whose count grows with the
number of micro-batches (the same case at 2 and at 4 micro-batches per step). Syncs inside
megatron's forward/backward schedule are attributed to `step.py:run_batches` and are not
intended. Each case runs in its own process (`python -m tests.gpu.test_host_sync`).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
INTENDED = {
    "ftcore/training/step.py:loss_sums": "loss and target-token sums, one read per step",
    "ftcore/training/step.py:reduce_sums": "the all-reduced sums on the host, per step",
    "ftcore/training/optim.py:*": "gradient norm, clipping, update decision, once per step",
    # megatron's finalize_model_grads tests `num_tokens > 0` before the per-token scaling
    "ftcore/training/trainer.py:_finalize_grads": "megatron's token-count read, once per step",
    "ftcore/training/objectives/dpo/step.py:run_pairs": "DPO's loss and metric sums, one read per step",
    "ftcore/training/objectives/grpo/step.py:run": "GRPO's loss and metric sums, one read per step",
}
WARMUP, STEPS = 3, 2
# an intended read happens a few times a step; one per parameter or per layer is not intended
# (megatron's gradient norm without TE/Apex read each gradient: 58 a step, 4-layer LoRA, H200)
MAX_PER_STEP = 6
MARK = "host syncs: "
BASE = [
    "cluster.device=cuda",
    "precision=bf16",
    "train.micro_batch_size=1",
    "train.max_steps=100",
    "eval.interval=0",
    "checkpoint.interval=0",
    "checkpoint.save_at_end=false",
    "logger.progress=lines",
]
CASES = {
    # THD packed rows with Transformer Engine (fused attention, fused THD RoPE); without TE the
    # local layers with the document mask
    "full_packed": ["+exp=tiny_full", "data.packing=true"],
    # megatron's local layers on the GPU: document mask, ftcore's document buckets
    "full_packed_local": ["+exp=tiny_full", "data.packing=true", "precision.te_layers=false"],
    "lora_unpacked": ["+exp=tiny_lora", "data.packing=false"],
    # what `make gpu-check`'s throughput run trains without TE: LoRA, packed rows, local layers
    "lora_packed_local": ["+exp=tiny_lora", "data.packing=true", "precision.te_layers=false"],
    # DPO from the stored reference (issue 50, item 8: its rows were copied to the GPU inside the
    # loss, blocking, per micro-batch). No MoE case: megatron's dispatcher and experts read the
    # tokens per expert on the host in every MoE layer, by design.
    "dpo_precompute": ["+exp=tiny_dpo", "objective.precompute_ref=true", "data.packing=false"],
}


def _site(stack: list[traceback.FrameSummary]) -> dict:
    """Where a sync came from: the innermost frame in the ftcore package, and the last frames."""
    import ftcore

    pkg = Path(ftcore.__file__).resolve().parent
    owner = "(no ftcore frame)"
    for f in reversed(stack):
        path = Path(f.filename).resolve()
        if path.is_relative_to(pkg):
            owner = f"ftcore/{path.relative_to(pkg).as_posix()}:{f.name}"
            break
    return {
        "owner": owner,
        "stack": [f"{f.filename}:{f.lineno} {f.name}: {f.line}" for f in stack[-8:]],
    }


def intended(owner: str) -> bool:
    return owner in INTENDED or f"{owner.split(':')[0]}:*" in INTENDED


@contextlib.contextmanager
def record_syncs(sites: list):
    """Every synchronizing CUDA call inside, with the Python stack that made it."""
    import torch

    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")

        def show(message, category, filename, lineno, file=None, line=None):
            # CUDA's own text; not set_sync_debug_mode's "prototype feature" warning
            if "called a synchronizing CUDA operation" in str(message):
                sites.append(_site(traceback.extract_stack()[:-1]))

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(prev)


def measure(run_dir: str, overrides: list[str]) -> dict:
    """In this process: set up a run, WARMUP steps, then STEPS steps with syncs recorded."""
    import torch

    from ftcore.config.schema import compose
    from ftcore.precision import recipes
    from ftcore.training import trainer

    cfg = compose(overrides + BASE + [f"run.dir={run_dir}"])
    state = trainer.setup(cfg)
    for _ in range(WARMUP):
        trainer.train_step(state)
    torch.cuda.synchronize()
    sites: list = []
    skipped = False
    with record_syncs(sites):
        for _ in range(STEPS):
            skipped |= bool(trainer.train_step(state).get("skipped", False))
    torch.cuda.synchronize()
    return {"sites": sites, "te": recipes.use_te(state.cfg), "skipped": skipped}


def run_case(tmp_path: Path, name: str, global_batch: int) -> dict:
    run_dir = tmp_path / f"{name}_{global_batch}"
    cmd = [sys.executable, "-m", "tests.gpu.test_host_sync", str(run_dir),
           *CASES[name], f"train.global_batch_size={global_batch}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    return json.loads(line[len(MARK) :])


def _describe(sites: list[dict]) -> str:
    return "\n\n".join(f"{s['owner']}\n  " + "\n  ".join(s["stack"]) for s in sites)


@pytest.mark.parametrize("name", list(CASES))
def test_no_unintended_host_sync(tmp_path, name, record_property):
    counts = {}
    for micro_batches in (2, 4):
        res = run_case(tmp_path, name, micro_batches)
        counts[micro_batches] = {}
        for s in res["sites"]:
            counts[micro_batches][s["owner"]] = counts[micro_batches].get(s["owner"], 0) + 1
        # per step, by place, in the junit file: `make gpu-check` puts it in its report
        per_step = {o: n / STEPS for o, n in counts[micro_batches].items()}
        record_property(f"host_syncs_per_step_{micro_batches}_micro_batches", json.dumps(per_step))
        print(f"{name}, {micro_batches} micro-batches, TE {res['te']}: {counts[micro_batches]}")
        assert not res["skipped"], "the measured step was skipped (non-finite loss or norm)"
        bad = [s for s in res["sites"] if not intended(s["owner"])]
        assert not bad, (
            f"{name} (TE layers: {res['te']}, {micro_batches} micro-batches): {len(bad)} unintended "
            f"host syncs in {STEPS} steady-state steps:\n{_describe(bad)}"
        )
        many = {o: n for o, n in per_step.items() if n > MAX_PER_STEP}
        assert not many, f"{name}: more than {MAX_PER_STEP} syncs a step from one place: {many}"
    assert counts[2] == counts[4], f"{name}: intended syncs grow with the micro-batches: {counts}"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(MARK + json.dumps(measure(sys.argv[1], sys.argv[2:])))
