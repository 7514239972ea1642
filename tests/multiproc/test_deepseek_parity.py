"""DeepSeek-V3-class training across layouts (docs/deepseek.md): five fp32 steps of a full
fine-tune of the tiny DeepSeek-V3 checkpoint (tests/support/deepseek.py: latent attention, YaRN,
shared expert, sigmoid router with a non-zero expert bias, groups, routed scaling, a dense first
layer) at ep=2 x tp=2 (SP), ep=2 x pp=2 and ep=2 x cp=2 give the one-process run's LM loss,
aux_loss, expert load and expert-bias shift to 1e-5. The expert bias moves
(moe.expert_bias_update_rate > 0: megatron's aux-loss-free balancing, its token counts summed over
TP x DP x CP), so a layout that counted tokens otherwise would route otherwise and show in the
loss. The parity matrix's row for these models is stated in docs/deepseek.md.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.deepseek import make_tiny
from tests.support.tiny import TINY

RTOL = 1e-5
STEPS = 5
TRAIN = ["precision=fp32", f"train.max_steps={STEPS}", "optim.lr=3e-3", "sched.warmup_steps=0",
         "moe.aux_loss_coeff=0.05", "moe.expert_bias_update_rate=0.01"]  # fmt: skip
LAYOUTS = {
    "ep2_tp2": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true"]),
    "ep2_pp2": (4, ["parallel.ep=2", "parallel.pp=2"]),
    "ep2_cp2": (2, ["parallel.ep=2", "parallel.cp=2"]),
}
KEYS = {"aux_loss": "aux_loss", "load": "expert_load_max_over_mean",
        "bias": "expert_bias_shift"}  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    path = make_tiny(tmp_path_factory.mktemp("deepseek") / "deepseek_v3", "deepseek_v3", seed=3)
    return [f"model.hf_path={path}", *TRAIN]


def train_case(overrides: list[str], run_dir: str, steps: int) -> dict:
    """`steps` training steps as `python -m ftcore.train` makes them; per step the LM loss, the
    grad norm and the MoE metrics as metrics.jsonl gets them."""
    from ftcore.config.schema import compose
    from ftcore.training import trainer

    state = trainer.setup(compose([*TINY, *overrides, f"run.dir={run_dir}"]))
    out: dict = {"loss": [], "grad_norm": [], **{k: [] for k in KEYS}}
    for _ in range(steps):
        step = trainer.train_step(state)
        assert not step.get("skipped"), step
        state.step += 1
        out["loss"].append(step["loss"])
        out["grad_norm"].append(step["grad_norm"])
        for k, v in KEYS.items():
            out[k].append(step["metrics"][v])
    return out


def _close(got, ref, what: str, rtol: float = RTOL) -> None:
    a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    rel = ((a - b).abs() / b.abs().clamp_min(1e-12)).max().item()
    assert rel <= rtol, f"{what}: max relative difference {rel:.2e} > {rtol} ({got} vs {ref})"


@pytest.fixture(scope="module")
def reference(pool1, base, tmp_path_factory) -> dict:
    return pool1.run(train_case, base, str(tmp_path_factory.mktemp("ref") / "run"), STEPS)[0]


@pytest.mark.dist
def test_reference_moves_the_expert_bias(reference):
    """The one-process run itself: the loss falls, the bias moves by the update rate each step
    (sign steps of 0.01: 0.01 after the first step, at most 0.05 after five), the load is
    between balance and the worst possible (E/k = 2)."""
    assert reference["loss"][-1] < reference["loss"][0], reference["loss"]
    assert abs(reference["bias"][0] - 0.01) < 1e-6, reference["bias"]
    assert all(0.0 < b <= 0.05 + 1e-6 for b in reference["bias"]), reference["bias"]
    assert all(1.0 <= x <= 2.0 for x in reference["load"]), reference["load"]


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_layout_matches_one_process(request, reference, base, tmp_path, layout):
    world, over = LAYOUTS[layout]
    pool = request.getfixturevalue(f"pool{world}")
    got = pool.run(train_case, [*base, *over], str(tmp_path), STEPS)[0]
    _close(got["loss"], reference["loss"], f"{layout} LM loss")
    for k in KEYS:
        _close(got[k], reference[k], f"{layout} {k}")
    _close(got["grad_norm"], reference["grad_norm"], f"{layout} grad norm", 1e-4)
