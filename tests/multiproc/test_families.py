"""Qwen2, Qwen3 and Mistral against transformers' own models (ftcore/config/families.py).

Per family, kept to few runs (each multi-process run costs seconds of setup on 2 cores):
- TP=2 (one 2-rank run): logits and `ftcore.eval`'s loss equal HF's to 1e-5 relative, and the live
  export (hf_model/) is bit-identical to the source and loads in transformers (for Qwen2 also a
  TP=2 checkpoint exported in one process: the q/k/v bias through dist_checkpointing);
- TP=1 (one 1-rank run): logits and eval loss;
- LoRA at TP=2 on all seven HF target names: PEFT loads the adapter on the transformers model and
  agrees with ftcore to 1e-5; the merge at TP=2 gives the PEFT model's logits (1e-4).
TP=2 x PP=2 runs for Qwen3 only (q/k norms and an explicit head dim are the furthest from Llama),
with a checkpoint of that layout exported in one process (the `python -m ftcore.export` path)
bit-identical to the source. Llama's versions are test_hf_load.py, test_hf_export.py and
test_lora_oracle.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.hf_helpers import (
    SEQ,
    assert_exported,
    check_against_hf,
    hf_model,
    hf_text_loss,
    load_case,
    make_tiny_hf,
    rel_error,
    tokens,
    write_text_data,
)

FAMILIES = ["qwen2", "qwen3", "mistral"]
TIED = {"qwen2": True}  # Qwen2.5's small models tie; the others untied
RTOL = 1e-5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> the tiny model, its text data, HF's logits and loss (made on first use)."""
    root, cache = tmp_path_factory.mktemp("families"), {}

    def get(family: str) -> dict:
        if family not in cache:
            path = make_tiny_hf(root / family, family=family, tie=TIED.get(family, False), seed=11)
            data = write_text_data(root / f"{family}.jsonl", n=7, seed=4)
            x = tokens(seed=6)
            with torch.no_grad():
                logits = hf_model(path)(input_ids=x).logits.float()
            cache[family] = {"path": str(path), "data": str(data), "x": x, "logits": logits,
                             "loss": hf_text_loss(path, data)}  # fmt: skip
        return cache[family]

    return get


def _check(results, ref, what):
    check_against_hf(results, ref, what, RTOL)


def _bit_identical(out: Path, ref: dict, what: str) -> None:
    want = hf_model(ref["path"]).state_dict()
    if TIED.get(what.split()[0]):
        want.pop("lm_head.weight", None)
    assert_exported(out, want, ref, what)


@pytest.mark.dist
@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_eval_and_export(family, pool2, built, tmp_path):
    ref = built(family)
    save = family == "qwen2"  # the q/k/v bias through a TP=2 checkpoint too
    results = pool2.run(load_case, ref["path"], str(tmp_path), ["parallel.tp=2"], ref["x"],
                        ref["data"], export=True, save=save)  # fmt: skip
    _check(results, ref, f"{family} tp2")
    _bit_identical(tmp_path / "hf_model", ref, f"{family} tp2")
    if save:
        from ftcore.export import resolve_step_dir, run_config
        from ftcore.hf.export import export_checkpoint

        step = resolve_step_dir(str(tmp_path))
        out = export_checkpoint(step, run_config(step), tmp_path / "exported")
        _bit_identical(out, ref, f"{family} tp2 checkpoint")


@pytest.mark.dist
@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_eval(family, pool1, built, tmp_path):
    ref = built(family)
    _check(pool1.run(load_case, ref["path"], str(tmp_path), [], ref["x"], ref["data"]), ref,
           f"{family} tp1")  # fmt: skip


@pytest.mark.dist
def test_qwen3_tp2_pp2_and_checkpoint_export(pool4, built, tmp_path):
    from ftcore.export import resolve_step_dir, run_config
    from ftcore.hf.export import export_checkpoint

    ref = built("qwen3")
    layout = ["parallel.tp=2", "parallel.pp=2"]
    results = pool4.run(load_case, ref["path"], str(tmp_path), layout, ref["x"], ref["data"],
                        save=True)  # fmt: skip
    _check(results, ref, "qwen3 tp2 x pp2")
    step = resolve_step_dir(str(tmp_path))
    out = export_checkpoint(step, run_config(step), tmp_path / "exported", max_shard_gb=0.0002)
    _bit_identical(out, ref, "qwen3 tp2 x pp2 checkpoint")


def lora_case(hf_dir: str, run_dir: str, x: torch.Tensor) -> dict:
    """Worker: test_lora_oracle's case on all seven HF names without its checkpoint (the adapter
    checkpoint path is family-independent): LoRA steps at TP=2, logits, loss, hf_adapter/, the
    merged live export."""
    from megatron.core import parallel_state as ps

    from ftcore.data.pipeline import MicroBatch
    from ftcore.hf.export import write_hf_model
    from ftcore.peft.adapter_format import write_hf_adapter
    from ftcore.peft.merge import live_merge_transform
    from ftcore.training import trainer
    from tests.multiproc.test_lora_oracle import ALL7, LORA, STEPS
    from tests.support.hf_helpers import compose_hf, forward_logits
    from tests.support.layouts import SyntheticLoader

    targets = f"peft.target_modules=[{','.join(ALL7)}]"
    cfg = compose_hf(hf_dir, run_dir, LORA + ["parallel.tp=2", targets])
    state = trainer.setup(cfg, data=False)
    state.loader = SyntheticLoader(cfg, ps.get_data_parallel_rank(), state.dp, 2048)
    for _ in range(STEPS):
        trainer.train_step(state)
    inp, labels = x[:, :SEQ], x[:, 1:]
    logits = forward_logits(state, inp)
    mb = MicroBatch(tokens=inp, labels=labels, loss_mask=torch.ones(labels.shape),
                    position_ids=torch.arange(SEQ).expand_as(inp),
                    segment_ids=torch.ones(inp.shape, dtype=torch.int32), num_tokens=inp.numel())  # fmt: skip
    loss_sum, n = trainer.run_batches(state, [mb], forward_only=True)
    write_hf_adapter(state)
    merged = write_hf_model(
        state, transform=live_merge_transform(state), out=Path(run_dir) / "merged"
    )
    return {"logits": logits, "loss": loss_sum / n, "merged": str(merged)}


@pytest.mark.dist
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_tp2_peft_oracle(family, pool2, built, tmp_path):
    from peft import PeftModel

    path = built(family)["path"]
    x = tokens(batch=2, seq=SEQ + 1)
    ours = next(r for r in pool2.run(lora_case, path, str(tmp_path), x) if r["logits"] is not None)
    peft_model = PeftModel.from_pretrained(hf_model(path), str(tmp_path / "hf_adapter")).eval()
    with torch.no_grad():
        want = peft_model(input_ids=x[:, :SEQ]).logits.float()
        base = hf_model(path)(input_ids=x[:, :SEQ]).logits.float()
        merged = hf_model(ours["merged"])(input_ids=x[:, :SEQ]).logits.float()
    assert rel_error(want, base) > 1e-3, "the adapter did not change the model"
    assert rel_error(ours["logits"], want) <= RTOL, (
        f"{family}: ftcore vs PEFT {rel_error(ours['logits'], want):.2e}"
    )
    loss = torch.nn.functional.cross_entropy(want.double().reshape(-1, want.shape[-1]),
                                             x[:, 1:].reshape(-1)).item()  # fmt: skip
    assert abs(ours["loss"] - loss) <= RTOL * loss, f"{family}: loss {ours['loss']} vs PEFT {loss}"
    assert rel_error(merged, want) <= 1e-4, (
        f"{family}: merged at TP=2 vs PEFT {rel_error(merged, want):.2e}"
    )
