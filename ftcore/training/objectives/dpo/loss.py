"""DPO's losses and metrics from per-token log-probs, as TRL 1.16 defines them (trl/trainer/
dpo_trainer.py, `_compute_loss`; docs/preference.md).

A pair's sequence log-prob is the sum of its completion tokens' log-probs; the reward of a side is
beta * (policy - reference) log-prob. Per pair: sigmoid -logsigmoid(beta*delta), hinge
relu(1 - beta*delta), ipo ((chosen/n_c - rejected/n_r) - 1/(2 beta))^2 on the log-ratios divided
by the completion token counts, robust (TRL's label-smoothed sigmoid), sft the mean NLL of the
chosen completion tokens; summed with their weights. Every value is a mean over pairs: what TRL's
`evaluate` gives with one pair per batch, and what makes micro-batching, DP and packing leave it
unchanged (sums over pairs, divided by the number of pairs of the global batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# metrics.jsonl / ftcore.eval keys, TRL's names; each a sum over pairs until divided
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@dataclass(frozen=True)
class Objective:
    """The objective section's DPO settings, read once."""

    beta: float = 0.1
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0

    @classmethod
    def of(cls, cfg) -> Objective:
        o = cfg.objective
        w = tuple(float(x) for x in o.loss_weights) if o.loss_weights is not None else None
        return cls(float(o.beta), tuple(o.loss_type), w, float(o.label_smoothing))

    @property
    def weights(self) -> tuple[float, ...]:
        return self.loss_weights or (1.0,) * len(self.loss_type)


def sequence_sums(
    token_logps: torch.Tensor, pair_index: torch.Tensor, pair_side: torch.Tensor, num_pairs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (pair, side) sums of the log-probs of its completion tokens and their counts, [P, 2]
    each: tokens with pair_index < 0 (prompt, padding) count for nothing."""
    keep = pair_index >= 0
    slot = torch.where(keep, pair_index * 2 + pair_side, torch.zeros_like(pair_index)).reshape(-1)
    w = keep.reshape(-1).to(token_logps.dtype)
    slots = 2 * max(num_pairs, 1)  # an all-padding micro-batch (no pairs) still has slot 0
    sums = torch.zeros(slots, dtype=token_logps.dtype, device=token_logps.device)
    sums = sums.index_add(0, slot, token_logps.reshape(-1) * w)
    counts = torch.zeros_like(sums).index_add(0, slot, w)
    return sums.view(-1, 2)[:num_pairs], counts.view(-1, 2)[:num_pairs]


def pair_losses(
    obj: Objective, policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The weighted sum of the objective's losses, per pair [P], from [P, 2] (chosen, rejected)
    sequence log-probs of the policy and the reference and completion token counts."""
    beta, ls = obj.beta, obj.label_smoothing
    chosen_lr = policy[:, 0] - reference[:, 0]
    rejected_lr = policy[:, 1] - reference[:, 1]
    delta = chosen_lr - rejected_lr
    total = torch.zeros_like(delta)
    for name, weight in zip(obj.loss_type, obj.weights, strict=True):
        if name == "sigmoid":
            loss = -F.logsigmoid(beta * delta)
        elif name == "hinge":
            loss = torch.relu(1 - beta * delta)
        elif name == "ipo":  # TRL: log-ratios per completion token
            n = counts.clamp(min=1.0)
            loss = (chosen_lr / n[:, 0] - rejected_lr / n[:, 1] - 1 / (2 * beta)) ** 2
        elif name == "robust":
            clean = -(1 - ls) * F.logsigmoid(beta * delta)
            flipped = -ls * F.logsigmoid(-beta * delta)
            loss = (clean - flipped) / (1 - 2 * ls)
        elif name == "sft":  # mean NLL over the chosen completion tokens
            loss = -policy[:, 0] / counts[:, 0].clamp(min=1.0)
        else:  # the config check names the choices first (validation/objective.py)
            raise ValueError(f"unknown DPO loss {name!r}")
        total = total + weight * loss
    return total


def metric_sums(obj: Objective, policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """METRICS summed over the pairs (detached), in that order."""
    policy, reference = policy.detach(), reference.detach()
    chosen = obj.beta * (policy[:, 0] - reference[:, 0])
    rejected = obj.beta * (policy[:, 1] - reference[:, 1])
    return torch.stack([
        chosen.sum(), rejected.sum(), (chosen > rejected).to(chosen.dtype).sum(),
        (chosen - rejected).sum(), policy[:, 0].sum(), policy[:, 1].sum(),
    ])  # fmt: skip


def means(loss_sum: float, pairs: float, sums: list[float]) -> dict[str, float]:
    """`loss` and METRICS as means over `pairs`."""
    n = max(pairs, 1.0)
    return {"loss": loss_sum / n, **{k: v / n for k, v in zip(METRICS, sums, strict=True)}}
