"""Generation with megatron's KV cache: greedy tokens equal the recomputing path's and, with an
adapter ftcore trained, transformers + PEFT's `generate`, at TP=2 and PP=2; after the prompt
each forward feeds the model one new position per row; a seeded top-p run repeats."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_helpers import compose_hf, hf_model, make_tiny_hf

LORA = ["peft=lora", "peft.r=4", "peft.lora_alpha=8", "optim.lr=1e-2", "sched.warmup_steps=0"]
PROMPTS = [[5, 9, 11, 3, 7], [4, 1, 8, 2, 6, 10, 12, 13, 14], [20, 21, 22]]  # ragged on purpose
NEW = 6


def _fed_widths(state) -> list:
    """[batch, width] of every forward's input ids on this rank (none past the first stage)."""
    seen = []
    for chunk in state.model:
        for name, m in chunk.named_modules():
            if name.endswith("embedding.word_embeddings"):
                m.register_forward_pre_hook(lambda mod, args: seen.append(list(args[0].shape)))
    return seen


def cache_case(run_dir: str, layout: list[str]) -> dict:
    """Greedy answers with and without the cache, and the widths each forward fed."""
    from ftcore.inference.generation import generate_ids
    from ftcore.training import trainer
    from tests.support.layouts import build

    state = build([*LORA, *layout], run_dir)
    for _ in range(2):  # non-zero LoRA B: the adapter takes part
        trainer.train_step(state)
    seen = _fed_widths(state)
    out = {}
    for cache in (False, True):
        seen.clear()
        out[cache] = {"ids": generate_ids(state, PROMPTS, max_new_tokens=NEW, kv_cache=cache),
                      "widths": list(seen)}  # fmt: skip
    out["sampled"] = [generate_ids(state, PROMPTS, max_new_tokens=4, temperature=1.0, top_p=0.9,
                                   seed=s) for s in (7, 7, 8)]  # fmt: skip
    return out


@pytest.mark.dist
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"]], ids=["tp2", "pp2"])
def test_kv_cache_keeps_greedy_tokens_and_feeds_one_position(pool2, tmp_path, layout):
    res = pool2.run(cache_case, str(tmp_path), layout)
    assert res[0][True]["ids"] == res[1][True]["ids"]  # every rank has the answers
    plain, cached = res[0][False], res[0][True]
    assert cached["ids"] == plain["ids"] and all(len(a) == NEW for a in cached["ids"])
    shortest = min(map(len, PROMPTS))
    first, *rest = cached["widths"]
    assert first == [len(PROMPTS), shortest]  # the common prefix once
    assert rest and all(w[1] == 1 for w in rest), cached["widths"]  # then one position per row
    steps = max(map(len, PROMPTS)) + NEW - shortest  # positions after the shortest prompt
    assert len(rest) == steps - 1
    fed = sum(b * w for b, w in cached["widths"])
    assert fed == len(PROMPTS) * shortest + sum(len(p) + NEW - shortest - 1 for p in PROMPTS)
    assert sum(b * w for b, w in plain["widths"]) > 2 * fed  # the recomputing path: O(length^2)
    a, again, other = res[0]["sampled"]  # top-p sampling, seeded: the same run twice
    assert a == again == res[1]["sampled"][0] and a != other


def sp_case(run_dir: str) -> list:
    from ftcore.inference.generation import generate_ids, kv_cache_applies
    from tests.support.layouts import build

    state = build(["parallel.tp=2", "parallel.sp=true"], run_dir)
    assert not kv_cache_applies(state.cfg)  # a 1-token step cannot shard over TP ranks
    return [generate_ids(state, PROMPTS, max_new_tokens=3, kv_cache=c) for c in (False, True)]


@pytest.mark.dist
def test_sequence_parallel_falls_back_to_recomputing(pool2, tmp_path):
    plain, cached = pool2.run(sp_case, str(tmp_path))[0]
    assert plain == cached and all(len(a) == 3 for a in plain)


def train_adapter_case(hf_dir: str, run_dir: str) -> str:
    from megatron.core import parallel_state as ps

    from ftcore.peft.adapter_format import write_hf_adapter
    from ftcore.training import trainer
    from tests.support.layouts import SyntheticLoader

    # a large step, so the adapter changes the greedy tokens (else the comparison proves nothing)
    cfg = compose_hf(
        hf_dir, run_dir, [*LORA, "peft.lora_alpha=32", "optim.lr=0.1", "parallel.tp=2"]
    )
    state = trainer.setup(cfg, data=False)
    state.loader = SyntheticLoader(cfg, ps.get_data_parallel_rank(), state.dp, 2048)
    for _ in range(4):
        trainer.train_step(state)
    return str(write_hf_adapter(state))


def adapter_generate_case(hf_dir: str, run_dir: str, adapter: str, layout: list[str]) -> list:
    from ftcore.inference.generation import generate_ids
    from ftcore.training import trainer

    cfg = compose_hf(hf_dir, run_dir, ["peft=lora", f"peft.adapter_path={adapter}", *layout])
    state = trainer.setup(cfg, data=False)
    return generate_ids(state, PROMPTS, max_new_tokens=NEW)  # the KV cache: the default


@pytest.mark.dist
def test_greedy_with_trained_adapter_matches_peft(pool2, tmp_path):
    from peft import PeftModel

    hf_dir = str(make_tiny_hf(tmp_path / "hf"))
    adapter = pool2.run(train_adapter_case, hf_dir, str(tmp_path / "train"))[0]
    model = PeftModel.from_pretrained(hf_model(hf_dir), adapter).eval()
    want, base = [], []
    for p in PROMPTS:
        kw = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                  attention_mask=torch.ones(1, len(p), dtype=torch.long))  # fmt: skip
        with torch.no_grad():
            want.append(model.generate(input_ids=torch.tensor([p]), **kw)[0, len(p) :].tolist())
            with model.disable_adapter():
                base.append(model.generate(input_ids=torch.tensor([p]), **kw)[0, len(p) :].tolist())
    assert want != base, "the adapter changes no token: the test would prove nothing"
    for name, layout in {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}.items():
        got = pool2.run(adapter_generate_case, hf_dir, str(tmp_path / name), adapter, layout)
        assert got[0] == got[1] == want, name
