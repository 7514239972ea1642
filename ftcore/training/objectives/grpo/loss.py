"""GRPO's advantages, loss and metrics, as TRL 1.16 defines them (trl/trainer/grpo_trainer.py:
`_generate_and_score_completions` for the advantages, `_compute_loss` for the loss; docs/grpo.md).

Advantages (TRL's `sum_then_normalize`): a completion's reward is the weighted sum of its reward
functions' values (NaN ones skipped; all NaN: unscorable, advantage 0); its advantage is the reward
minus the mean of its group's (the num_generations completions of one prompt), divided by
(std + 1e-4) where std is the group's (scale_rewards=group), the whole batch's (batch), or not
divided (none). The std is Bessel-corrected, as TRL's `nanstd`.

Per completion token, with the policy's log-prob l, the rollout policy's l_old (l itself, detached,
with num_iterations=1) and the reference's l_ref, all of logits / temperature:
  r = exp(l - l_old),  loss = -min(r A, clamp(r, 1 - epsilon, 1 + epsilon_high) A)
                             + beta r^c (exp(l_ref - l) - (l_ref - l) - 1)  (k3 KL estimator)
where c = 1 with use_bias_correction_kl (TRL's default: the ratio makes the KL gradient the
unbiased reverse-KL one, DeepSeek-V3.2), else 0; the loss is
aggregated per loss_type over a global batch of N completions: grpo the mean over completions of
each one's token mean; dapo the sum over all completion tokens / their number; dr_grpo the sum /
(N max_completion_length); bnpo each micro-batch's token mean, averaged over the micro-batches.
Every one is a sum over micro-batches divided by a count summed over them (megatron's
`calculate_per_token_loss`), so micro-batching and DP leave grpo, dapo and dr_grpo unchanged; bnpo
depends on the micro-batch, as TRL's "local batch" normalisation does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
# metrics.jsonl keys of the update, TRL's names; each a sum until divided (clip_ratio/low_min and
# clip_ratio/high_max are a min and a max over completions)
TOKEN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                 "clip_ratio/region_mean")  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """The objective section's GRPO settings, read once."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    temperature: float = 1.0
    max_completion_length: int = 256
    num_generations: int = 8
    scale_rewards: str = "group"
    num_iterations: int = 1
    use_bias_correction_kl: bool = True

    @classmethod
    def of(cls, cfg) -> Settings:
        o = cfg.objective
        high = o.epsilon if o.epsilon_high is None else o.epsilon_high
        return cls(str(o.loss_type), float(o.beta), float(o.epsilon), float(high),
                   float(o.temperature), int(o.max_completion_length), int(o.num_generations),
                   str(o.scale_rewards), int(o.num_iterations), bool(o.use_bias_correction_kl))  # fmt: skip


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's `nanstd`: Bessel-corrected, NaNs skipped, NaN where fewer than two values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    corr = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var * corr)
    return std.squeeze(dim) if dim is not None else std.squeeze()


@dataclass
class Scored:
    advantages: torch.Tensor  # [N] float32
    rewards: torch.Tensor  # [N] weighted sums, NaN where unscorable
    metrics: dict  # reward, reward_std, rewards/NAME/mean|std, frac_reward_zero_std


def advantages(per_func: torch.Tensor, weights: torch.Tensor, names: list[str],
               s: Settings) -> Scored:  # fmt: skip
    """TRL's advantages and reward metrics from [N, F] rewards (NaN: not scored), N = groups x G."""
    per_func, weights = per_func.float(), weights.float()
    g = s.num_generations
    unscorable = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
    if s.scale_rewards == "batch":
        std = (
            nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        )
    else:  # group, and none (whose std is only logged)
        std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g)
    adv = rewards - mean
    if s.scale_rewards != "none":
        adv = adv / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    adv = torch.nan_to_num(adv, nan=0.0)
    metrics = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = nanstd(rewards).item()
    metrics["frac_reward_zero_std"] = zero_std.float().mean().item()
    return Scored(adv, rewards, metrics)


def token_losses(s: Settings, logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None,
                 adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Per token: (loss, ratio r, KL or None), all of one shape."""
    ratio = torch.exp(logps - old)
    kl = None
    if s.beta != 0.0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if s.use_bias_correction_kl:  # the unbiased reverse-KL gradient (TRL's default)
            kl = kl * ratio
    clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    if kl is not None:
        loss = loss + s.beta * kl
    return loss, ratio, kl


def per_sequence(
    values: torch.Tensor, seq: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows] sums of `values` over each sequence's completion tokens (seq: the row of each token,
    -1 where it is no target) and [rows] token counts."""
    keep = seq >= 0
    idx = torch.where(keep, seq, torch.zeros_like(seq)).reshape(-1)
    w = keep.reshape(-1).to(values.dtype)
    sums = values.new_zeros(max(rows, 1)).index_add(0, idx, values.reshape(-1) * w)
    counts = values.new_zeros(max(rows, 1)).index_add(0, idx, w)
    return sums[:rows], counts[:rows]


def aggregate(
    s: Settings, loss: torch.Tensor, seq: torch.Tensor, rows: int
) -> tuple[torch.Tensor, int | torch.Tensor]:
    """A micro-batch's (loss sum, count): the global loss is the sum of the sums over the sum of
    the counts (module docstring)."""
    sums, counts = per_sequence(loss, seq, rows)
    if s.loss_type == "grpo":
        return (sums / counts.clamp(min=1.0)).sum(), rows
    if s.loss_type == "bnpo":
        return sums.sum() / counts.sum().clamp(min=1.0), 1
    if s.loss_type == "dr_grpo":
        return sums.sum() / s.max_completion_length, rows
    if s.loss_type == "dapo":
        return sums.sum(), counts.sum().to(torch.int)
    raise ValueError(f"unknown GRPO loss {s.loss_type!r}")  # validation names the choices first


@torch.no_grad()
def metric_sums(s: Settings, ratio: torch.Tensor, kl: torch.Tensor | None, entropy: torch.Tensor,
                adv: torch.Tensor, seq: torch.Tensor, rows: int) -> torch.Tensor:  # fmt: skip
    """TOKEN_METRICS summed over the completion tokens, their count, then the smallest
    per-completion share of low-clipped tokens and the largest of high-clipped (inf / -inf
    where no completion has a token), as one float64 vector."""
    low = ((ratio < 1 - s.epsilon_low) & (adv < 0)).double()
    high = ((ratio > 1 + s.epsilon_high) & (adv > 0)).double()
    region = ((low + high) > 0).double()
    kl = torch.zeros_like(ratio) if kl is None else kl
    out = []
    for v in (kl.double(), entropy.double(), low, high, region):
        out.append(per_sequence(v, seq, rows)[0].sum())
    lows, counts = per_sequence(low, seq, rows)
    highs, _ = per_sequence(high, seq, rows)
    has = counts > 0
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=ratio.device)
    low_min = torch.where(has, lows / counts.clamp(min=1), inf).min() if rows else inf
    high_max = torch.where(has, highs / counts.clamp(min=1), -inf).max() if rows else -inf
    return torch.stack([*out, counts.sum(), low_min, high_max])


def metric_means(s: Settings, sums: list[float], low_min: float, high_max: float) -> dict:
    """The update's metrics from the world's sums (and min, max): TRL's global masked means."""
    *values, tokens = sums
    n = max(tokens, 1.0)
    out = {k: v / n for k, v in zip(TOKEN_METRICS, values, strict=True)}
    if s.beta == 0.0:
        del out["kl"]  # TRL logs kl only with a KL term
    out["clip_ratio/low_min"] = low_min if low_min != float("inf") else float("nan")
    out["clip_ratio/high_max"] = high_max if high_max != float("-inf") else float("nan")
    return out
