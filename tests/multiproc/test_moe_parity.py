"""Mixture of experts (issue 43) beyond the parity matrix (which runs the MoE model, full and LoRA
on its experts and router, at ep=2 crossed with TP+SP, PP, PP x VP, CP, DP, the distributed
optimizer and recompute against the one-process run: tests/multiproc/test_parity_matrix.py):
saved at ep=2 with the distributed optimizer and resumed at ep=1 x dp=2 (optimizer state
included), the next steps give the uninterrupted ep=2 run's losses to 1e-6; padding leaves the
auxiliary loss as it is (docs/moe.md, "The auxiliary loss").
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.support.moe import make_tiny_moe
from tests.support.tiny import TINY

RTOL = 1e-5
STEPS = 5
SAVE_AT = 2  # the ep=2 run with the distributed optimizer saves here; resumed at ep=1 x dp=2
# a large coefficient and a z-loss, so a mis-scaled auxiliary gradient shows in the LM loss
AUX = ["moe.aux_loss_coeff=0.1", "moe.z_loss_coeff=0.001", "optim.lr=3e-3", "sched.warmup_steps=0"]
DISTOPT = "parallel.distributed_optimizer=true"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    path = make_tiny_moe(tmp_path_factory.mktemp("moe") / "qwen3_moe", num_hidden_layers=4)
    return [f"model.hf_path={path}", "precision=fp32", f"train.max_steps={STEPS}", *AUX]


def run_case(overrides: list[str], run_dir: str, steps: int, save_at: int = 0):
    """`steps` training steps as `python -m ftcore.train` makes them (trainer.setup with its data
    loader, resuming from run_dir's checkpoint if there is one); per step the LM loss, aux_loss
    and expert load as metrics.jsonl gets them."""
    from ftcore.checkpoint import store
    from ftcore.config.schema import compose
    from ftcore.training import trainer

    state = trainer.setup(compose([*TINY, *overrides, f"run.dir={run_dir}"]))
    out = {"start": state.step, "loss": [], "aux_loss": [], "load": [], "grad_norm": []}
    for _ in range(steps):
        step = trainer.train_step(state)
        assert not step.get("skipped"), step
        state.step += 1
        out["loss"].append(step["loss"])
        out["aux_loss"].append(step["metrics"]["aux_loss"])
        out["load"].append(step["metrics"]["expert_load_max_over_mean"])
        out["grad_norm"].append(step["grad_norm"])
        if state.step == save_at:
            store.save(state)
    return out


def _close(got, ref, what: str, rtol: float = RTOL) -> None:
    a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    rel = ((a - b).abs() / b.abs().clamp_min(1e-12)).max().item()
    assert rel <= rtol, f"{what}: max relative difference {rel:.2e} > {rtol} ({got} vs {ref})"


@pytest.fixture(scope="module")
def ep2_distopt(pool2, base, tmp_path_factory):
    """ep=2 with the distributed optimizer, saving at SAVE_AT: the resume test's uninterrupted
    run."""
    d = tmp_path_factory.mktemp("ep2_distopt")
    got = pool2.run(run_case, [*base, "parallel.ep=2", DISTOPT], str(d), STEPS, SAVE_AT)
    return got[0], d


@pytest.mark.dist
def test_resume_at_another_ep_size(pool2, base, ep2_distopt, tmp_path):
    """ep=2 -> ep=1 x dp=2, distributed optimizer both times: experts' weights and Adam state
    reshard (megatron's sharded state dicts with expert offsets)."""
    ref, first = ep2_distopt
    shutil.copytree(first, tmp_path / "run")
    got = pool2.run(run_case, [*base, DISTOPT], str(tmp_path / "run"), STEPS - SAVE_AT)
    assert got[0]["start"] == SAVE_AT
    _close(got[0]["loss"], ref["loss"][SAVE_AT:], "resumed LM loss", 1e-6)
    _close(got[0]["aux_loss"], ref["aux_loss"][SAVE_AT:], "resumed aux_loss", 1e-6)


def padding_case(overrides: list[str], run_dir: str) -> list[tuple[float, float, float]]:
    """One step on rows of 14-28 real tokens then padding, padded to data.seq_len, and the same
    step again from the same weights on the rows trimmed to each micro-batch's longest (as
    data.trim_padding does). Returns (loss, aux_loss, load) of each."""
    from ftcore.data.pipeline import MicroBatch
    from ftcore.training import trainer
    from tests.support.layouts import build, global_batch, stack

    state = build(overrides, run_dir)
    rows = global_batch(0, 8, 32, state.cfg.model.vocab_size)
    for i, r in enumerate(rows):
        n = 14 + 2 * i
        for t in (r.tokens, r.labels, r.loss_mask, r.segment_ids):
            t[0, n:] = 0
        r.num_tokens = n
    padded = [stack(rows[i : i + 2]) for i in range(0, 8, 2)]
    width = [int((mb.segment_ids > 0).sum(dim=1).max()) for mb in padded]
    trimmed = [MicroBatch(mb.tokens[:, :w], mb.labels[:, :w], mb.loss_mask[:, :w],
                          mb.position_ids[:, :w], mb.segment_ids[:, :w], mb.num_tokens)
               for mb, w in zip(padded, width)]  # fmt: skip
    weights = [p.detach().clone() for p in state.model[0].parameters()]
    out = []
    for mbs in (padded, trimmed):
        for p, w in zip(state.model[0].parameters(), weights):
            p.data.copy_(w)
        state.loader = type("Fixed", (), {"next_microbatches": lambda self, mbs=mbs: mbs})()
        step = trainer.train_step(state)
        out.append(
            (
                step["loss"],
                step["metrics"]["aux_loss"],
                step["metrics"]["expert_load_max_over_mean"],
            )
        )
    return out


@pytest.mark.dist
def test_padding_leaves_aux_loss(pool1, base, tmp_path):
    """Padding counts nowhere: the router gets megatron's padding mask (segment 0), so padded and
    trimmed rows give one LM loss, one aux_loss and one expert load."""
    padded, trimmed = pool1.run(padding_case, base, str(tmp_path))[0]
    _close(padded, trimmed, "loss, aux_loss, load with padding vs trimmed", 1e-6)
