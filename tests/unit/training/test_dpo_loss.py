"""DPO's per-pair sums and losses on synthetic batches (the oracle against TRL itself is
tests/unit/training/test_dpo_oracle.py)."""

from __future__ import annotations

import math

import torch

from ftcore.training.objectives.dpo.loss import Objective, metric_sums, pair_losses, sequence_sums


def test_sequence_sums_per_pair_and_side():
    """Two rows, each one pair's side after a prompt: sums and counts land in their slots."""
    logps = torch.tensor([[-9.0, -1.0, -2.0, -9.0], [-9.0, -9.0, -3.0, -4.0]])
    index = torch.tensor([[-1, 0, 0, -1], [-1, -1, 1, 1]])
    side = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 0]])
    sums, counts = sequence_sums(logps, index, side, 2)
    assert sums.tolist() == [[-3.0, 0.0], [-4.0, -3.0]]
    assert counts.tolist() == [[2.0, 0.0], [1.0, 1.0]]


def test_losses_at_known_points():
    """Policy = reference: sigmoid log 2, hinge 1, ipo 1/(2 beta)^2; sft the chosen mean NLL."""
    pol = torch.tensor([[-4.0, -6.0]])
    counts = torch.tensor([[2.0, 3.0]])
    one = {t: pair_losses(Objective(beta=0.5, loss_type=(t,)), pol, pol, counts).item()
           for t in ("sigmoid", "hinge", "ipo", "sft")}  # fmt: skip
    assert math.isclose(one["sigmoid"], math.log(2), rel_tol=1e-6) and one["hinge"] == 1.0
    assert one["ipo"] == 1.0 and one["sft"] == 2.0
    both = Objective(beta=0.5, loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.25))
    assert math.isclose(pair_losses(both, pol, pol, counts).item(), math.log(2) + 0.5, rel_tol=1e-6)
    # robust at label_smoothing 0 is sigmoid; a margin of +2 at beta 0.5: -logsigmoid(1)
    ref = torch.tensor([[-5.0, -5.0]])
    r = pair_losses(Objective(beta=0.5, loss_type=("robust",)), pol, ref, counts).item()
    assert math.isclose(r, -math.log(1 / (1 + math.exp(-1.0))), rel_tol=1e-6)
    m = metric_sums(Objective(beta=0.5), pol, ref).tolist()
    assert m == [0.5, -0.5, 1.0, 1.0, -4.0, -6.0]


def test_a_micro_batch_without_pairs():
    """The padding micro-batch that fills an evaluation's last global batch: no pairs, no error."""
    sums, counts = sequence_sums(
        torch.zeros(1, 4), torch.full((1, 4), -1), torch.full((1, 4), -1), 0
    )
    assert sums.shape == (0, 2) and counts.shape == (0, 2)
