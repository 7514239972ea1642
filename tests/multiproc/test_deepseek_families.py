"""DeepSeek-V3 (MLA with and without q_lora_rank) and GLM-4.5 against transformers' own models
(docs/deepseek.md).

The oracle is transformers' model of the family on the same tokens (its logits, and its LM loss
on the eval data as `ftcore.eval` reads it): ftcore at one process, ep=2, tp=2 and ep=2 x pp=2
gives it to 1e-5 relative. The tiny checkpoints (tests/support/deepseek.py) hold every feature at
once: a dense first layer then three MoE layers, eight routed experts and a shared one, sigmoid
scores with a non-zero expert bias, a routed scaling factor; DeepSeek-V3's latent attention, YaRN
with both mscales and grouped routing; GLM-4.5's partial rotary, q/k/v biases and q/k norms. The
export (live at one process and ep=2, and from an ep=2 checkpoint in one process) is bit-identical
to what transformers saved, the multi-token-prediction layer's tensors included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.deepseek import make_tiny, mtp_tensors
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

RTOL = 1e-5
CASES = {  # name -> (family, q_lora)
    "deepseek_v3": ("deepseek_v3", True),
    "deepseek_v3_no_q_lora": ("deepseek_v3", False),
    "glm4_moe": ("glm4_moe", True),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> the tiny model, its text data, transformers' logits and loss (on first use)."""
    root, cache = tmp_path_factory.mktemp("deepseek"), {}

    def get(case: str) -> dict:
        if case not in cache:
            family, q_lora = CASES[case]
            path = make_tiny(root / case, family, seed=11, q_lora=q_lora, with_mtp=q_lora)
            data = write_text_data(root / f"{case}.jsonl", n=7, seed=4)
            x = tokens(seed=6)
            with torch.no_grad():
                logits = hf_model(path)(input_ids=x).logits.float()
            cache[case] = {"path": str(path), "data": str(data), "x": x, "logits": logits,
                           "loss": hf_text_loss(path, data), "mtp": q_lora}  # fmt: skip
        return cache[case]

    return get


def _bit_identical(out: Path, ref: dict, what: str) -> None:
    """Every tensor as transformers saved it (the expert bias and shared experts included), same
    dtype and bytes, plus the MTP layer's tensors unchanged; transformers loads it as the model."""
    want = read_hf_dir(ref["path"])
    assert (not ref["mtp"]) or set(mtp_tensors(hf_model(ref["path"]).config)) <= set(want)
    assert_exported(out, want, ref, what)


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_one_process_eval_and_export(case, pool1, built, tmp_path):
    ref = built(case)
    res = pool1.run(load_case, ref["path"], str(tmp_path), [], ref["x"], ref["data"], export=True)
    check_against_hf(res, ref, f"{case} 1 process", RTOL)
    _bit_identical(tmp_path / "hf_model", ref, f"{case} 1 process")


@pytest.mark.dist
@pytest.mark.parametrize("case", ["deepseek_v3", "glm4_moe"])
def test_ep2_eval_and_export(case, pool2, built, tmp_path):
    """Also a checkpoint of ep=2 (each EP rank saving its experts, the expert bias in the
    router's state) exported in one process (`python -m ftcore.export`), bit-identical too."""
    from ftcore.export import resolve_step_dir, run_config
    from ftcore.hf.export import export_checkpoint

    ref = built(case)
    res = pool2.run(load_case, ref["path"], str(tmp_path), ["parallel.ep=2"], ref["x"], ref["data"],
                    export=True, save=True)  # fmt: skip
    check_against_hf(res, ref, f"{case} ep2", RTOL)
    _bit_identical(tmp_path / "hf_model", ref, f"{case} ep2")
    step = resolve_step_dir(str(tmp_path))
    out = export_checkpoint(step, run_config(step), tmp_path / "exported", max_shard_gb=0.0002)
    _bit_identical(out, ref, f"{case} ep2 checkpoint")


LAYOUTS = {"ep2_tp2": ["parallel.ep=2", "parallel.tp=2"], "ep2_pp2": ["parallel.ep=2", "parallel.pp=2"],
           "tp2": ["parallel.tp=2"]}  # fmt: skip


@pytest.mark.dist
@pytest.mark.parametrize(
    "case,layout",
    [("deepseek_v3", "ep2_tp2"), ("deepseek_v3", "ep2_pp2"), ("glm4_moe", "ep2_tp2"),
     ("glm4_moe", "ep2_pp2"), ("deepseek_v3_no_q_lora", "tp2")],
)  # fmt: skip
def test_layouts_eval(case, layout, pool4, built, tmp_path):
    """TP splits MLA's heads (q_b or q_proj, kv_b, o_proj by head; the down projections by rows,
    gathered); each rank reads only its own experts' tensors (EP rank r: experts 4r .. 4r+3)."""
    from tests.multiproc.test_moe_families import reads_case

    ref = built(case)
    res = pool4.run(reads_case, ref["path"], str(tmp_path), LAYOUTS[layout], ref["x"], ref["data"])
    check_against_hf(res, ref, f"{case} {layout}", RTOL)
    per = 8 // (2 if "ep2" in layout else 1)
    for r in res:
        want = set(range(per * r["ep_rank"], per * r["ep_rank"] + per))
        assert r["experts"] == want, (r["rank"], r["experts"])
