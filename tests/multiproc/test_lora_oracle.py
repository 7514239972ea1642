"""PEFT is the oracle: after a few LoRA steps at TP=2, `hf_adapter/` loaded by
`PeftModel.from_pretrained` on the Hugging Face model gives ftcore's logits and loss (1e-5), the
merged model (live export with the merge transform, and the HF-space merge of the files) gives the
PEFT model's logits (1e-4), and the trainable count equals PEFT's for the same HF target names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.hf_helpers import SEQ, compose_hf, forward_logits, hf_model, make_tiny_hf, tokens

STEPS = 3
LORA = ["peft=lora", "peft.r=4", "peft.lora_alpha=8", "optim.lr=1e-2", "sched.warmup_steps=0"]
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {"all7": ALL7, "shared_A": ["linear_qkv", "linear_fc1"]}


def oracle_case(hf_dir: str, run_dir: str, targets: list[str], x: torch.Tensor) -> dict:
    """Worker: train a few LoRA steps at this layout, then logits, loss, hf_adapter/, merged export."""
    from megatron.core import parallel_state as ps

    from ftcore.checkpoint import store
    from ftcore.data.pipeline import MicroBatch
    from ftcore.hf.export import write_hf_model
    from ftcore.peft.adapter_format import write_hf_adapter
    from ftcore.peft.lora import count_params
    from ftcore.peft.merge import live_merge_transform
    from ftcore.training import trainer
    from tests.support.layouts import SyntheticLoader

    cfg = compose_hf(
        hf_dir, run_dir, LORA + ["parallel.tp=2", f"peft.target_modules=[{','.join(targets)}]"]
    )
    state = trainer.setup(cfg, data=False)
    state.loader = SyntheticLoader(cfg, ps.get_data_parallel_rank(), state.dp, 2048)
    counts = count_params(state.cfg, state.model)
    for _ in range(STEPS):
        trainer.train_step(state)
    inp, labels = x[:, :SEQ], x[:, 1:]
    logits = forward_logits(state, inp)
    mb = MicroBatch(tokens=inp, labels=labels, loss_mask=torch.ones(labels.shape), position_ids=torch.arange(SEQ).expand_as(inp),
                    segment_ids=torch.ones(inp.shape, dtype=torch.int32), num_tokens=inp.numel())  # fmt: skip
    loss_sum, n = trainer.run_batches(state, [mb], forward_only=True)
    write_hf_adapter(state)
    state.step = STEPS
    store.save(state, blocking=True)  # adapter-only, sharded at TP=2
    store.wait(state)
    merged = write_hf_model(
        state, transform=live_merge_transform(state), out=Path(run_dir) / "hf_merged"
    )
    return {"logits": logits, "loss": loss_sum / n, "counts": counts, "merged": str(merged)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_hf(tmp_path_factory.mktemp("hf") / "llama"))


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_peft_loads_what_ftcore_trained(case, pool2, tiny, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    from ftcore.peft.merge import write_merged_model

    x = tokens(batch=2, seq=SEQ + 1)
    results = pool2.run(oracle_case, tiny, str(tmp_path), CASES[case], x)
    ours = next(r for r in results if r["logits"] is not None)
    peft_model = PeftModel.from_pretrained(hf_model(tiny), str(tmp_path / "hf_adapter")).eval()
    with torch.no_grad():
        want = peft_model(input_ids=x[:, :SEQ]).logits.float()
        base = hf_model(tiny)(input_ids=x[:, :SEQ]).logits.float()
    assert _rel(want, base) > 1e-3, (
        "the adapter did not change the model: the test would prove nothing"
    )
    rel = _rel(ours["logits"], want)
    assert rel <= 1e-5, f"{case}: ftcore logits vs PEFT's differ by {rel:.2e}"
    loss = F.cross_entropy(want.double().reshape(-1, want.shape[-1]), x[:, 1:].reshape(-1)).item()
    assert abs(ours["loss"] - loss) <= 1e-5 * loss, f"{case}: loss {ours['loss']} vs PEFT {loss}"
    # merged: the live export with the merge transform, and the HF-space merge of the files
    offline = write_merged_model(tiny, tmp_path / "hf_adapter", tmp_path / "merged_offline")
    for where in (ours["merged"], offline):
        with torch.no_grad():
            got = hf_model(where)(input_ids=x[:, :SEQ]).logits.float()
        rel = _rel(got, want)
        assert rel <= 1e-4, f"{case}: merged model {where} vs base+adapter differ by {rel:.2e}"
    # the TP=2 adapter-only checkpoint, exported in one process (python -m ftcore.export's path)
    from safetensors.torch import load_file

    from ftcore.export import resolve_step_dir, run_config
    from ftcore.peft.merge import export_adapter_checkpoint

    step = resolve_step_dir(str(tmp_path))
    ad = export_adapter_checkpoint(step, run_config(step), tmp_path / "ckpt_adapter", merge=False)
    a, b = (
        load_file(str(ad / "adapter_model.safetensors")),
        load_file(str(tmp_path / "hf_adapter" / "adapter_model.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    merged = export_adapter_checkpoint(step, run_config(step), tmp_path / "ckpt_merged", merge=True)
    with torch.no_grad():
        rel = _rel(hf_model(merged)(input_ids=x[:, :SEQ]).logits.float(), want)
    assert rel <= 1e-4, f"{case}: merged export of the checkpoint differs by {rel:.2e}"
    if case == "all7":
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=ALL7, task_type="CAUSAL_LM")
        trainable, total = get_peft_model(hf_model(tiny), cfg).get_nb_trainable_parameters()
        assert results[0]["counts"] == (trainable, total)
