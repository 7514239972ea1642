"""Adapters in and QLoRA, one process each: a run started from `peft.adapter_path` holds exactly the
adapter another run wrote; QLoRA stores the frozen base in NF4, trains only adapters, and its loss
tracks full-precision LoRA's; greedy decoding at TP=2 and PP=2 equals transformers' `generate`."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_helpers import compose_hf, hf_model, make_tiny_hf
from tests.support.layouts import build, full_weights

LORA = ["peft.r=4", "peft.lora_alpha=8", "optim.lr=1e-2", "sched.warmup_steps=0"]
ALL7 = "peft.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def write_adapter_case(run_dir: str) -> dict:
    from ftcore.peft.adapter_format import write_hf_adapter
    from ftcore.training import trainer

    state = build(
        ["peft=lora", "peft.target_modules=[linear_qkv,o_proj,down_proj]", *LORA], run_dir
    )
    for _ in range(2):
        trainer.train_step(state)
    return {
        "path": str(write_hf_adapter(state)),
        "weights": full_weights(state, trainable_only=True),
    }


def load_adapter_case(run_dir: str, adapter: str) -> dict:
    state = build(["peft=lora", f"peft.adapter_path={adapter}", "peft.r=16"], run_dir)
    return {"weights": full_weights(state, trainable_only=True)}


@pytest.mark.dist
def test_adapter_path_round_trip(pool1, tmp_path):
    """Shared-A adapter out (A copied to q/k/v), back in as HF-named adapters: the model computes
    the same function (each q/k/v slice sees the same A and its own B)."""
    wrote = pool1.run(write_adapter_case, str(tmp_path / "a"))[0]
    got = pool1.run(load_adapter_case, str(tmp_path / "b"), wrote["path"])[0]["weights"]
    pre = "decoder.layers.{}.self_attention.linear_qkv."
    for k, w in wrote["weights"].items():
        if "lora_A.linear_qkv" in k:
            layer = k.split(".")[2]
            for s in ("q_proj", "k_proj", "v_proj"):
                assert torch.equal(got[pre.format(layer) + f"lora_A.{s}"], w)
        else:
            assert torch.equal(got[k], w), k
    assert (
        got["decoder.layers.0.mlp.linear_fc2.lora_A.down_proj"].shape[0] == 4
    )  # r from the adapter


def qlora_case(run_dir: str, name: str) -> dict:
    from ftcore.models.nf4 import NF4ParallelLinear
    from ftcore.training import trainer

    state = build([f"peft={name}", ALL7, *LORA, "train.micro_batch_size=4"], run_dir)
    nf4 = [m for c in state.model for m in c.modules() if isinstance(m, NF4ParallelLinear)]
    trainable = {n for c in state.model for n, p in c.named_parameters() if p.requires_grad}
    losses = [trainer.train_step(state)["loss"] for _ in range(4)]
    out = {"loss": losses, "nf4": len(nf4), "trainable": trainable}
    if nf4:
        m = nf4[0]
        x = torch.randn(3, 1, m.shape[1])
        out["exact"] = torch.equal(m(x)[0], torch.nn.functional.linear(x, m.weight_fp()))
        out["packed"] = (m.qweight.dtype, m.qweight.numel(), m.shape[0] * m.shape[1])
    return out


@pytest.mark.dist
def test_qlora_trains_adapters_on_nf4_base(pool1, tmp_path):
    q = pool1.run(qlora_case, str(tmp_path / "q"), "qlora")[0]
    lo = pool1.run(qlora_case, str(tmp_path / "l"), "lora")[0]
    assert q["nf4"] == 4 * 4  # every linear of the 4 layers
    assert q["exact"]
    dtype, stored, logical = q["packed"]
    assert dtype == torch.uint8 and stored * 2 == logical  # 4 bits per weight
    assert q["trainable"] == lo["trainable"] and all(".lora_" in n for n in q["trainable"])
    assert q["loss"][-1] < q["loss"][0]
    rel = [abs(a - b) / b for a, b in zip(q["loss"], lo["loss"])]
    assert max(rel) < 1e-2, f"QLoRA loss strays from LoRA's: {rel}"


def generate_case(
    hf_dir: str, run_dir: str, layout: list[str], prompts: list[list[int]], n: int
) -> list:
    from ftcore.inference.generation import generate_ids
    from ftcore.training import trainer

    state = trainer.setup(compose_hf(hf_dir, run_dir, layout), data=False)
    return generate_ids(state, prompts, max_new_tokens=n)


@pytest.mark.dist
def test_greedy_decoding_matches_transformers(pool2, tmp_path):
    hf_dir = make_tiny_hf(tmp_path / "hf")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 2048, (k,), generator=g).tolist() for k in (5, 9, 3)]
    model = hf_model(hf_dir)
    want = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))  # fmt: skip
        want.append(out[0, len(p) :].tolist())
    for name, layout in {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}.items():
        got = pool2.run(generate_case, str(hf_dir), str(tmp_path / name), layout, prompts, 6)
        assert got[0] == got[1] == want, layout
