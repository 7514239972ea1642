"""HF Llama -> ftcore under TP=1, TP=2, PP=2, TP=2 x PP=2 (gloo, fp32): logits match HF's to 1e-5
relative, ftcore.eval's loss matches HF's own loss on the same text data to 1e-5, and the round trip
HF -> ftcore (TP=2 x PP=2) -> hf_model/ gives back bit-identical tensors that transformers loads."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.hf_helpers import (
    check_against_hf,
    hf_model,
    hf_text_loss,
    load_case,
    make_tiny_hf,
    tokens,
    write_text_data,
)

RTOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    path = make_tiny_hf(root / "llama")
    data = write_text_data(root / "text.jsonl")
    x = tokens()
    with torch.no_grad():
        logits = hf_model(path)(input_ids=x).logits.float()
    return {
        "path": str(path),
        "data": str(data),
        "x": x,
        "logits": logits,
        "loss": hf_text_loss(path, data),
    }


def _check(results, tiny, what):
    check_against_hf(results, tiny, what, RTOL)


@pytest.mark.dist
def test_tp1(pool1, tiny, tmp_path):
    results = pool1.run(load_case, tiny["path"], str(tmp_path), [], tiny["x"], tiny["data"])
    _check(results, tiny, "tp1")
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved == results[0]["eval"]


@pytest.mark.dist
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"]], ids=["tp2", "pp2"])
def test_two_ranks(pool2, tiny, tmp_path, layout):
    _check(
        pool2.run(load_case, tiny["path"], str(tmp_path), layout, tiny["x"], tiny["data"]),
        tiny,
        layout[0],
    )


@pytest.mark.dist
def test_tp2_pp2_and_round_trip(pool4, tiny, tmp_path):
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    results = pool4.run(load_case, tiny["path"], str(tmp_path), ["parallel.tp=2", "parallel.pp=2"],
                        tiny["x"], tiny["data"], export=True)  # fmt: skip
    _check(results, tiny, "tp2 x pp2")
    out = tmp_path / "hf_model"
    assert results[0]["export"] == str(out)
    ref = hf_model(tiny["path"]).state_dict()
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            got.update({k: st.get_tensor(k) for k in st.keys()})
    assert set(got) == set(ref), set(got) ^ set(ref)
    for k, t in ref.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k], t), f"{k} is not bit-identical after the round trip"
    back = LlamaForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=tiny["x"]).logits, tiny["logits"], rtol=0, atol=0)
    from transformers import AutoTokenizer

    tok, src = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(tiny["path"])
    assert tok.chat_template == src.chat_template and tok.get_vocab() == src.get_vocab()
    assert tok.eos_token == src.eos_token
