"""The parity matrix through the command line (tests/support/matrix.py, docs/parallelism.md):
each pairwise run is `python -m ftcore.train` on 2-4 local processes, held to the one-process run
of the same command without its layout, optimizer-sharding and recompute keys: losses to 1e-5
(fp32) and the same tokens every step (the promise), gradient norms to 1e-4 and the exported
weights (hf_model/ or hf_adapter/) to 1e-3 of each tensor's norm, coarse guards against a layout
bug, which moves whole tensors by O(1). Measured (2026-11-27): losses within 1e-7; gradient norms
within 2.5e-5 (CP and PP sum the gradients of different positions in another order); weights
within 2e-4, all in the last layer's lora_B, whose target-position path differs by layout
(models/target_logits.py) and whose Adam update divides each element by its own RMS, so rounding
in elements near adam_eps becomes lr-sized moves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support import matrix
from tests.support.cli import cli

RTOL = 1e-5
GRAD_RTOL = 1e-4
WEIGHT_RTOL = 1e-3
RUNS = matrix.runs()


def _train(args: list[str], run_dir: Path) -> dict:
    proc = cli("train", *args, f"run.dir={run_dir}", timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    out = next(p for p in (run_dir / "hf_model", run_dir / "hf_adapter") if p.is_dir())
    weights = {}
    for f in sorted(out.glob("*.safetensors")):
        weights.update(load_file(f))
    return {k: [x[k] for x in steps] for k in ("loss", "grad_norm", "tokens")} | {
        "weights": weights
    }


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One one-process run per (method, rows), made when a run first needs it."""
    cache: dict[tuple, dict] = {}

    def get(key: tuple) -> dict:
        if key not in cache:
            d = tmp_path_factory.mktemp("ref-" + "-".join(key))
            cache[key] = _train(matrix.reference_command(key), d)
        return cache[key]

    return get


def _close(got, ref, what: str, rtol: float = RTOL) -> None:
    a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    rel = ((a - b).abs() / b.abs().clamp_min(1e-12)).max().item()
    assert rel <= rtol, f"{what}: max relative difference {rel:.2e} > {rtol} ({got} vs {ref})"


@pytest.mark.dist
@pytest.mark.parametrize("run", RUNS, ids=[matrix.name(r) for r in RUNS])
def test_run_matches_its_one_process_reference(run, references, tmp_path):
    ref = references(matrix.reference_key(run))
    got = _train(matrix.command(run), tmp_path / "run")
    assert len(got["loss"]) == len(ref["loss"]) == 3
    assert got["tokens"] == ref["tokens"], "the layout changed the documents a step trains on"
    _close(got["loss"], ref["loss"], "losses")
    _close(got["grad_norm"], ref["grad_norm"], "grad norms", GRAD_RTOL)
    assert got["weights"].keys() == ref["weights"].keys()
    for k, w in ref["weights"].items():
        diff = (got["weights"][k].double() - w.double()).norm().item()
        assert diff <= WEIGHT_RTOL * w.double().norm().item(), f"{k}: |diff| {diff:.2e}"
