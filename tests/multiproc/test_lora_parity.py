"""LoRA across TP beyond the parity matrix (which runs LoRA and QLoRA, on all seven modules and on a
shared-A linear_qkv, at every layout against one process: tests/multiproc/test_parity_matrix.py):
every TP shard of an adapter checkpoint saved at TP=2 comes back at TP=1 (MB #2252, #5840, #5634),
and with lora_dropout the replicated adapter halves stay identical on every TP rank."""

from __future__ import annotations

import pytest
import torch

from tests.support.layouts import build, full_weights, merge_weights

ALL7 = "peft.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
LORA = ["peft=lora", "peft.r=4", "peft.lora_alpha=8", "optim.lr=3e-3", "sched.warmup_steps=0"]


def _save_and_reload(overrides: list[str], run_dir: str, save: bool) -> dict:
    from ftcore.checkpoint import store
    from ftcore.training import trainer

    state = build(overrides + ["checkpoint.resume=auto"], run_dir)
    if save:
        for _ in range(2):
            trainer.train_step(state)
        state.step = 2
        store.save(state, blocking=True)
        store.wait(state)
    return {"weights": full_weights(state, trainable_only=True), "step": state.step}


@pytest.mark.dist
def test_adapter_checkpoint_tp2_reloads_at_tp1(pool1, pool2, tmp_path):
    """Every TP shard of every adapter is saved: TP=2 save -> TP=1 resume gives the same tensors."""
    over = LORA + [ALL7]
    saved = pool2.run(_save_and_reload, over + ["parallel.tp=2"], str(tmp_path), True)
    loaded = pool1.run(_save_and_reload, over, str(tmp_path), False)[0]
    assert loaded["step"] == 2
    want = merge_weights(saved)
    assert want.keys() == loaded["weights"].keys()
    for k, w in want.items():
        assert torch.equal(loaded["weights"][k], w), f"{k} differs after TP=2 -> TP=1 reload"
    assert any(w[w.shape[0] // 2 :].abs().sum() > 0 for k, w in want.items() if ".lora_B." in k)


def _replicas_after_dropout(overrides: list[str], run_dir: str) -> dict:
    from ftcore.models.sharding import iter_params
    from ftcore.training import trainer

    state = build(overrides, run_dir)
    losses = [trainer.train_step(state)["loss"] for _ in range(2)]
    reps = {
        n: p.detach().clone()
        for n, p in iter_params(state.model)
        if p.requires_grad and not p.tensor_model_parallel
    }
    return {"loss": losses, "replicated": reps}


@pytest.mark.dist
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_dropout_keeps_tp_replicas_identical(sp, pool2, tmp_path):
    """With lora_dropout the masks differ per TP rank only where the input does (SP chunks, sharded
    row inputs), so the replicated adapter halves stay identical on every TP rank."""
    over = LORA + [ALL7, "peft.lora_dropout=0.2", "parallel.tp=2", f"parallel.sp={str(sp).lower()}"]
    a, b = pool2.run(_replicas_after_dropout, over, str(tmp_path))
    assert all(torch.isfinite(torch.tensor(a["loss"])))
    assert a["replicated"].keys() == b["replicated"].keys() and a["replicated"]
    for k, w in a["replicated"].items():
        assert torch.equal(w, b["replicated"][k]), f"{k} differs across TP ranks"
