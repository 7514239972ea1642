"""The router's auxiliary losses weighted so that their optimised total is one number at every
layout, and the tokens each expert received, for metrics.jsonl (docs/moe.md).

megatron-core 0.16.1 with `calculate_per_token_loss` attaches each layer's load-balancing loss
times the router's LOCAL token count, padding included: under SP or CP a rank holds 1/tp or 1/cp
of the tokens, so the auxiliary gradient shrinks by tp·cp, and padding weighs in. Here every rank
attaches its share of the micro-batch's loss times the micro-batch's valid tokens (pooled over its
TP x CP ranks by megatron's own helper), and the step scale `target tokens / valid tokens` of the
whole global batch: after megatron divides every gradient by the target tokens, the optimised
auxiliary term is the token-weighted mean over the step's micro-batches of each layer's
coefficient x load-balancing loss (+ z-loss), summed over layers, whatever tp, cp, dp, ep, pp and
the micro-batch count. Padding (data.packing.real_tokens: the rows' ends and, packed under CP,
the pads after each document) reaches the router as megatron's padding mask and counts nowhere. The step scale is set for the whole step (`step_scale`), so a recomputed layer
(parallel.recompute) attaches the same values in the backward as the forward would have.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_tokens_per_expert_and_token_count,
    switch_load_balancing_loss_func,
)
from megatron.core.transformer.moe.router import TopKRouter

LB, Z, LOAD = 0, 1, 2  # columns of a router's stats: load-balancing, z-loss, tokens per expert...
_scale: dict[str, torch.Tensor | None] = {"value": None}  # target / valid tokens of this step


@contextmanager
def step_scale(scale: torch.Tensor):
    """While one global batch goes forward and backward: its target tokens / valid tokens (a
    0-d tensor on the device, so no host read)."""
    _scale["value"] = scale
    try:
        yield
    finally:
        _scale["value"] = None


class Router(TopKRouter):
    """megatron's top-k router with the weighting of the module docstring; it adds each training
    forward's weighted losses and per-expert token counts to `ftcore_stats` ([2 + experts])."""

    ftcore_stats: torch.Tensor | None = None

    def _stats(self, device) -> torch.Tensor:
        if self.ftcore_stats is None:
            self.ftcore_stats = torch.zeros(2 + self.config.num_moe_experts, device=device)
        return self.ftcore_stats

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        coeff = self.get_aux_loss_coeff("aux_loss")
        scale = _scale["value"]
        if coeff == 0 or scale is None:
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map,
                                           with_padding_mask)  # fmt: skip
        per_expert, _, valid = get_tokens_per_expert_and_token_count(
            routing_map, self.tp_cp_group, topk=self.topk, with_padding_mask=with_padding_mask
        )
        valid = torch.as_tensor(valid, dtype=torch.float32, device=probs.device).clamp_min(1.0)
        loss = switch_load_balancing_loss_func(
            probs=scores_for_aux_loss, tokens_per_expert=per_expert, total_num_tokens=valid,
            topk=self.topk, num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff,
            fused=self.config.moe_router_fusion,
        )  # fmt: skip
        weighted = loss * valid  # this rank's share of coeff x loss x the micro-batch's tokens
        self._stats(probs.device)[LB] += weighted.detach()
        return MoEAuxLossAutoScaler.apply(probs, weighted * scale)

    def apply_z_loss(self, logits, padding_mask=None):
        coeff, scale = self.config.moe_z_loss_coeff, _scale["value"]
        if coeff is None or scale is None or not (self.training and torch.is_grad_enabled()):
            return super().apply_z_loss(logits, padding_mask)
        z = torch.logsumexp(logits, dim=-1).square()
        if padding_mask is not None:
            z = z * (~padding_mask)
        weighted = coeff * z.sum()  # this rank's share of coeff x mean(z^2) x the tokens
        self._stats(logits.device)[Z] += weighted.detach()
        return MoEAuxLossAutoScaler.apply(logits, weighted * scale)

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        """megatron 0.16.1's count for the expert-bias update, with the padding mask ([tokens],
        True = padding) broadcast over the experts: megatron's `routing_map & ~padding_mask`
        raises for [tokens, experts] & [tokens] (docs/deepseek.md)."""
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def routing(self, logits, padding_mask=None):
        probs, routing_map = super().routing(logits, padding_mask)
        if self.training and torch.is_grad_enabled():  # once per micro-batch, recompute or not
            counted = routing_map
            if padding_mask is not None:
                counted = routing_map & ~padding_mask.reshape(-1, 1)
            self._stats(logits.device)[LOAD:] += counted.sum(dim=0)
        return probs, routing_map


def remember_bias(chunks: list) -> None:
    """Note each router's expert bias as loaded (the published one), for `bias_shift`."""
    for r in routers(chunks):
        if r.expert_bias is not None:
            r.ftcore_bias0 = r.expert_bias.detach().clone()


def bias_shift(r: Router) -> torch.Tensor:
    """The largest |expert bias - as loaded| of a router (0 without an expert bias); megatron
    moves it in finalize_model_grads by moe_router_bias_update_rate per step."""
    b0 = getattr(r, "ftcore_bias0", None)
    if r.expert_bias is None or b0 is None:
        return torch.zeros(())
    return (r.expert_bias.detach().float() - b0.float()).abs().max()


def install(chunks: list) -> list[Router]:
    """Make every top-k router of the chunks an ftcore Router (same parameters and state)."""
    routers = []
    for chunk in chunks:
        for module in chunk.modules():
            if type(module) is TopKRouter:
                module.__class__ = Router
            if isinstance(module, Router):
                routers.append(module)
    return routers


def routers(chunks: list) -> list[Router]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, Router)]


def padding_mask(chunk, pad: torch.Tensor) -> torch.Tensor:
    """megatron's MoE padding mask (True = padding) for `chunk` from this CP rank's rows [b, s]
    (`pad`: True at padding). megatron scatters it over the SP ranks in the first stage's
    embedding only; a later stage gets this TP rank's slice of the sequence here."""
    from megatron.core import parallel_state as ps

    if not chunk.pre_process and chunk.config.sequence_parallel:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        n = pad.shape[1] // tp
        pad = pad[:, rank * n : (rank + 1) * n]
    return pad.contiguous()
