"""Expert parallelism in the planner: the layouts megatron accepts and the all-to-all's time.

Megatron's expert grid orders its ranks etp, ep, expert-dp, pp (etp fastest), so an EP group's
ranks sit `etp` apart: the peers that share a rank's NVLink domain are min(ep, domain / etp) and the
rest are across the network. The alltoall dispatcher sends each routed token copy to the rank
holding its expert and brings the expert output back (dispatch + combine), forward and backward:
four all-to-alls per MoE layer and micro-batch (six with full recompute, which runs the forward
again). Each moves the busiest rank's routed copies (activations.moe_tokens: top-k x the assumed
imbalance) of which (ep - 1)/ep leave the rank; the NVLink and network parts run at once, so an
all-to-all takes the longer of the two. With etp > 1 the routed copies are also gathered over the
expert-TP group and reduce-scattered back (NVLink inside a node). ftcore does not overlap any of it
with compute (megatron's overlap_moe_expert_parallel_comm is not used): all of it is exposed. A
plan of a run that does overlap it (plan.moe_a2a_overlap: the published rows) hides the fitted
share cluster.ep_a2a_hidden of it, at most the rank's compute (throughput.ep_time).
"""

from __future__ import annotations

from collections.abc import Callable

from ftcore.planner.activations import Shape, moe_tokens
from ftcore.planner.params import is_moe

ETP_CHOICES = (1,)  # Megatron-Bridge's MoE recipes keep experts unsplit; tp is searched apart


def sizes(cfg) -> tuple[int, int]:
    p = cfg.parallel
    return getattr(p, "ep", 1) or 1, getattr(p, "etp", 1) or 1


def options(cfg, tp: int, ranks_per_stage: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs for `ranks_per_stage` = world / pp ranks: ep divides the expert count, and
    ep x etp divides the ranks (megatron's expert grid); etp is 1 or tp."""
    m = cfg.model
    if not is_moe(m):
        return [(1, 1)]
    out = []
    for etp in sorted({1, tp}):
        for ep in (1, 2, 4, 8, 16, 32, 64, 128):
            if m.num_experts % ep == 0 and ranks_per_stage % (ep * etp) == 0:
                out.append((ep, etp))
    return out


def peers_inside(ep: int, etp: int, domain: int) -> int:
    """EP peers (the rank itself included) inside one NVLink domain."""
    return max(1, min(ep, max(domain, 1) // etp))


def a2a_seconds(cfg, sh: Shape, rate: Callable[[bool], float], passes: int) -> float:
    """Exposed all-to-all (and expert-TP) seconds of one MoE layer, one micro-batch, busiest rank.
    `rate(inside)`: bytes/s per GPU over NVLink (True) or the network (False)."""
    ep, etp = sizes(cfg)
    if not sh.moe:
        return 0.0
    _, routed = moe_tokens(sh)
    nbytes = routed / etp * sh.h * sh.ab  # the copies one all-to-all moves on this rank
    ops = 2 * passes  # dispatch and combine per forward or backward pass
    t = 0.0
    if ep > 1:
        inside = peers_inside(ep, etp, cfg.cluster.nvlink_domain)
        t_in = nbytes * (inside - 1) / ep / rate(True)
        t_out = nbytes * (ep - inside) / ep / rate(False)
        t += ops * max(t_in, t_out)
    if etp > 1:
        t += ops * routed * sh.h * sh.ab * (etp - 1) / etp / rate(etp <= cfg.cluster.nvlink_domain)
    return t
