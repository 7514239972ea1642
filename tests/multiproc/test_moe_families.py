"""Qwen3-MoE and Mixtral against transformers' own models (docs/moe.md).

The oracle is transformers' model of the family on the same tokens (its logits, and its LM loss
on the eval data as `ftcore.eval` reads it): `ftcore.eval` at ep=1, ep=2, ep=2 x tp=2 and
ep=2 x pp=2 gives it to 1e-5 relative. The tiny checkpoints (tests/support/moe.py) have four
experts, top-2, and for Qwen3-MoE a dense layer between two sparse ones, so each pipeline stage of
pp=2 holds a different mix. The live export at ep=1 and at ep=2 (each EP rank writing its own
experts) and the export of an ep=2 checkpoint in one process are bit-identical to what transformers
saved and load back as the same model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.hf_helpers import (
    assert_exported,
    check_against_hf,
    hf_model,
    hf_text_loss,
    load_case,
    read_hf_dir,
    tokens,
    write_text_data,
)
from tests.support.moe import MOE_FAMILIES, make_tiny_moe

RTOL = 1e-5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> the tiny model, its text data, transformers' logits and loss (on first use)."""
    root, cache = tmp_path_factory.mktemp("moe"), {}

    def get(family: str) -> dict:
        if family not in cache:
            path = make_tiny_moe(root / family, family, seed=11)
            data = write_text_data(root / f"{family}.jsonl", n=7, seed=4)
            x = tokens(seed=6)
            with torch.no_grad():
                logits = hf_model(path)(input_ids=x).logits.float()
            cache[family] = {"path": str(path), "data": str(data), "x": x, "logits": logits,
                             "loss": hf_text_loss(path, data)}  # fmt: skip
        return cache[family]

    return get


def _bit_identical(out: Path, ref: dict, what: str) -> None:
    """Every tensor as transformers saved it (the published per-expert names), same dtype and
    bytes; transformers loads the directory as the same model."""
    assert_exported(out, read_hf_dir(ref["path"]), ref, what)


@pytest.mark.dist
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_ep1_eval_and_export(family, pool1, built, tmp_path):
    ref = built(family)
    res = pool1.run(load_case, ref["path"], str(tmp_path), [], ref["x"], ref["data"], export=True)
    check_against_hf(res, ref, f"{family} ep1", RTOL)
    _bit_identical(tmp_path / "hf_model", ref, f"{family} ep1")


@pytest.mark.dist
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_ep2_eval_and_export(family, pool2, built, tmp_path):
    """Also a checkpoint of ep=2 (each EP rank saving its experts) exported in one process (the
    `python -m ftcore.export` path), bit-identical too."""
    from ftcore.export import resolve_step_dir, run_config
    from ftcore.hf.export import export_checkpoint

    ref = built(family)
    res = pool2.run(load_case, ref["path"], str(tmp_path), ["parallel.ep=2"], ref["x"], ref["data"],
                    export=True, save=True)  # fmt: skip
    check_against_hf(res, ref, f"{family} ep2", RTOL)
    _bit_identical(tmp_path / "hf_model", ref, f"{family} ep2")
    step = resolve_step_dir(str(tmp_path))
    out = export_checkpoint(step, run_config(step), tmp_path / "exported", max_shard_gb=0.0002)
    _bit_identical(out, ref, f"{family} ep2 checkpoint")


def eval_case(hf_dir: str, run_dir: str, overrides: list[str], x: torch.Tensor, data: str) -> dict:
    """Worker: the run `ftcore.eval` builds (setup's kind "eval": at tp > 1 megatron's MoE layer
    needs no sequence parallelism outside training), its logits and its evaluation."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ftcore.eval import evaluate
    from ftcore.training import trainer
    from tests.support.hf_helpers import compose_hf, forward_logits

    cfg = compose_hf(hf_dir, run_dir, list(overrides) + [f"data.path={data}"])
    state = trainer.setup(cfg, data=False, kind="eval")
    logits = forward_logits(state, x)
    return {"logits": logits if ps.get_tensor_model_parallel_rank() == 0 else None,
            "rank": dist.get_rank(), "eval": evaluate(state.cfg, state)}  # fmt: skip


def reads_case(*args) -> dict:
    """Worker: eval_case, recording which experts' HF tensors this rank read."""
    import re

    from megatron.core import parallel_state as ps

    from ftcore.hf.io import SafetensorsDir

    read, experts = SafetensorsDir.read, set()

    def recording(self, piece):
        m = re.search(r"experts\.(\d+)\.", piece.hf or "")
        if m:
            experts.add(int(m.group(1)))
        return read(self, piece)

    SafetensorsDir.read = recording
    try:
        out = eval_case(*args)
    finally:
        SafetensorsDir.read = read
    return {**out, "experts": experts, "ep_rank": ps.get_expert_model_parallel_rank()}


@pytest.mark.dist
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"]], ids=["tp2", "pp2"])
def test_ep2_with_tp_or_pp_eval(family, layout, pool4, built, tmp_path):
    """Each rank reads only its own experts' tensors (EP rank r: experts 2r, 2r+1)."""
    ref = built(family)
    res = pool4.run(reads_case, ref["path"], str(tmp_path), ["parallel.ep=2"] + layout, ref["x"],
                    ref["data"])  # fmt: skip
    check_against_hf(res, ref, f"{family} ep2 x {layout[0]}", RTOL)
    for r in res:
        assert r["experts"] == {2 * r["ep_rank"], 2 * r["ep_rank"] + 1}, (r["rank"], r["experts"])


@pytest.mark.dist
def test_fused_layout_reads_at_ep2(pool2, built, tmp_path):
    """transformers 5's fused expert layout (save_original_format=False: 3D gate_up_proj and
    down_proj, the router under mlp.gate) loads at ep=2 as the published one does, and exports
    as the published per-expert layout, bit-identical."""
    from transformers import AutoTokenizer

    ref = built("mixtral")
    fused = tmp_path / "fused"
    hf_model(ref["path"]).save_pretrained(str(fused), save_original_format=False)
    AutoTokenizer.from_pretrained(ref["path"]).save_pretrained(str(fused))
    assert "model.layers.0.mlp.experts.gate_up_proj" in read_hf_dir(fused)
    res = pool2.run(load_case, str(fused), str(tmp_path / "run"), ["parallel.ep=2"], ref["x"],
                    ref["data"], export=True)  # fmt: skip
    check_against_hf(res, ref, "mixtral fused ep2", RTOL)
    _bit_identical(tmp_path / "run" / "hf_model", ref, "mixtral fused ep2")
