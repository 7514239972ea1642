"""Context parallelism (parallel.cp): which layouts the runtime accepts, and what moving K and V
between the ranks of a CP group costs in bytes, memory and exposed time.

The sequence is cut into 2*cp chunks and rank r holds chunks r and 2cp-1-r (megatron's and TE's
load balance), so each rank does 1/cp of the causal attention work. How the keys and values of
the other ranks reach a rank's queries is `parallel.cp_comm_type` (Transformer Engine's names):
- p2p: a ring of cp steps; each step computes one block while the next K/V chunk arrives, so a
  send is hidden when the block's attention takes longer. Backward sends K/V and dK/dV around the
  ring. TE keeps every received chunk until the layer's forward ends.
- all_gather: the whole sequence's K/V is gathered before attention (blocking), gathered again in
  backward and dK/dV reduce-scattered. TE saves only the local K/V for backward: the gathered
  copies are transient. (ftcore's CPU attention gathers under autograd, where SDPA saves them:
  activations.py.)
- a2a (Ulysses): all-to-all of q, k, v (sequence shards -> head shards) and of the output, both
  ways; the heads and kv groups of a TP rank must divide by cp.
- a2a+p2p: a2a inside groups of `a2a_size` consecutive CP ranks, the p2p ring across them.
The CPU runtime has one CP attention, an all-gather whatever the key says (activations.shape_of).
These rules are validation's too (validation/checks.py) and the layout search's (search.py).
"""

from __future__ import annotations

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
SEARCHED = ("p2p", "all_gather", "a2a")  # a2a+p2p needs megatron's hierarchical CP sizes
# The comm types TE's CP attention takes packed (THD) rows with. TE 2.9,
# transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py: the all-gather
# and all-to-all implementations assert `qkv_format != "thd"`, and a2a+p2p asserts it before it
# falls back to either half; only the p2p ring handles THD.
THD_COMM_TYPES = ("p2p",)


def te_attention(cfg) -> bool:
    """Transformer Engine's attention runs, and with it parallel.cp_comm_type: a GPU cluster with
    TE layers. QLoRA and precision.te_layers=false build megatron's local layers, whose CP
    attention (models/local/cp_attention.py) all-gathers K/V whatever the key says, as the CPU
    runtime's does."""
    return bool(
        cfg.cluster.device != "cpu" and cfg.precision.te_layers and cfg.peft.name != "qlora"
    )


def local_on_gpu(cfg) -> bool:
    """A GPU cluster running megatron's local layers: parallel.cp_comm_type does nothing there."""
    return cfg.cluster.device != "cpu" and not te_attention(cfg)


def thd_under_te(cfg) -> bool:
    """Packed rows reach Transformer Engine's attention as THD: data.packing where TE's attention
    runs (te_attention)."""
    return bool(cfg.data.packing and te_attention(cfg))


def comm_type(parallel) -> str:
    """parallel.cp_comm_type, "p2p" where a config predates the key."""
    return getattr(parallel, "cp_comm_type", None) or "p2p"


def seq_multiple(tp: int, sp: bool, cp: int) -> int:
    """What data.seq_len (and every trimmed row) must divide by: the 2*cp chunks of context
    parallelism (data/cp.py), each split over the TP ranks under SP (the multiple Megatron-Bridge
    pads to; a little stricter than lcm(2*cp, cp*tp), which the math alone needs)."""
    return (tp if sp else 1) * (2 * cp if cp > 1 else 1)


def sequence_multiple(parallel) -> int:
    """seq_multiple of a config's `parallel` section: what every row width must divide by
    (validation and the data pipeline; the layout search calls seq_multiple itself)."""
    return seq_multiple(parallel.tp, bool(parallel.sp), parallel.cp)


def hierarchical_sizes(parallel) -> list[int] | None:
    """megatron's hierarchical_context_parallel_sizes: parallel.hierarchical_cp_sizes, only under
    cp_comm_type=a2a+p2p (validation refuses them anywhere else)."""
    sizes = getattr(parallel, "hierarchical_cp_sizes", None)
    return [int(n) for n in sizes] if sizes and comm_type(parallel) == "a2a+p2p" else None


def a2a_size(model, tp: int, cp: int, comm: str, nvlink_domain: int = 8, sizes=None) -> int:
    """CP ranks one all-to-all spans: cp for a2a, 1 for p2p/all_gather; for a2a+p2p the first of
    parallel.hierarchical_cp_sizes, or (a plan without them) the largest divisor of cp whose heads
    divide and whose tp*size ranks stay in one NVLink domain: the planner's assumption."""
    if cp == 1 or comm in ("p2p", "all_gather"):
        return 1
    if comm == "a2a":
        return cp
    if sizes:
        return int(sizes[0])
    fits = [n for n in range(1, cp + 1) if cp % n == 0 and _heads_divide(model, tp, n)]
    inside = [n for n in fits if tp * n <= max(nvlink_domain, 1)]
    return max(inside or [1])


def _heads_divide(model, tp: int, n: int) -> bool:
    return (model.num_attention_heads // tp) % n == 0 and (model.num_query_groups // tp) % n == 0


def layout_problem(
    model, tp: int, cp: int, comm: str, sizes=None, thd: bool = False, local: bool = False
) -> tuple[str, str, str] | None:
    """(field, what is wrong, the fix) when TE would refuse this CP layout, else None. `thd`:
    packed rows go to TE's attention (thd_under_te); `local`: megatron's local layers run on a GPU
    cluster (local_on_gpu), which ignore any comm type but the default."""
    if comm not in COMM_TYPES:
        return ("parallel.cp_comm_type", f"{comm!r} is not one of {', '.join(COMM_TYPES)}",
                "p2p (the default) works for every model")  # fmt: skip
    if cp > 1 and local and comm != "p2p":
        return ("parallel.cp_comm_type",
                f"{comm} would do nothing: megatron's local layers (precision.te_layers=false, "
                "QLoRA) attend under context parallelism with ftcore's own all-gather "
                "(models/local/cp_attention.py), whatever parallel.cp_comm_type says",
                "leave parallel.cp_comm_type at p2p (the default), or run Transformer Engine's "
                "layers (precision.te_layers=true, not QLoRA), which take it")  # fmt: skip
    if cp > 1 and thd and comm not in THD_COMM_TYPES:
        return ("parallel.cp_comm_type",
                f"{comm} cannot take packed rows: Transformer Engine's context-parallel attention "
                "handles the packed (THD) layout with p2p only",
                "use parallel.cp_comm_type=p2p with data.packing=true (or data.packing=false)")  # fmt: skip
    n = cp if comm == "a2a" else int(sizes[0]) if comm == "a2a+p2p" and sizes else 1
    if cp > 1 and n > 1 and not _heads_divide(model, tp, n):
        heads, groups = model.num_attention_heads // tp, model.num_query_groups // tp
        return (
            "parallel.cp_comm_type",
            f"{comm} shards heads over {n} CP ranks, but a TP rank has {heads} heads and "
            f"{groups} kv groups",
            "use parallel.cp_comm_type=p2p or all_gather, or an all-to-all size that divides both",
        )
    return None


def kv_bytes(sh) -> int:
    """This rank's K and V of one layer, one micro-batch (activations.Shape)."""
    return sh.tokens * 2 * sh.kv // sh.tp * sh.ab


def transient_bytes(sh) -> int:
    """Bytes TE's CP attention allocates beside the saved activations while one layer's attention
    runs, the larger of forward and backward (freed after it): p2p keeps every received K/V chunk
    and each step's partial output through the forward, and two K/V + dK/dV buffers and dQ in
    backward; all_gather the gathered K/V of the whole sequence, its reordered copy and dK/dV of
    the whole sequence; a2a the exchanged and reordered q, k, v. On CPU the gathered K/V are
    saved activations instead (activations.py): 0 here."""
    if sh.cp == 1 or sh.impl == "local":
        return 0
    kv, out = kv_bytes(sh), sh.tokens * sh.q // sh.tp * sh.ab
    a2a = 2 * (2 * out + kv) if sh.a2a > 1 else 0  # q, k, v and the output, twice
    if sh.cp_comm == "all_gather":
        return 3 * sh.cp * kv
    ring = sh.cp // sh.a2a
    if ring == 1:
        return a2a
    return a2a + max(ring * (kv + out), 4 * kv + out)


def merge_bytes(sh, recompute_full: bool) -> int:
    """HBM bytes per layer and micro-batch of the p2p ring's merges (elementwise, not hidden):
    each step's partial output rescaled into the running output in forward (read it and the
    output, write the output), each step's dQ, dK, dV added into the accumulators in backward."""
    ring = sh.cp // sh.a2a if sh.cp_comm in ("p2p", "a2a+p2p") else 1
    if ring == 1 or sh.impl == "local":
        return 0
    fwd = ring * 3 * sh.ab * sh.tokens * sh.q // sh.tp
    bwd = ring * 3 * sh.ab * sh.tokens * (sh.q + 2 * sh.kv) // sh.tp
    return fwd * (2 if recompute_full else 1) + bwd


def exposed_s(sh, attn_s: tuple[float, float], link, recompute_full: bool) -> float:
    """Seconds of KV exchange per layer and micro-batch (forward, backward and a recomputed
    forward) not hidden behind attention. `attn_s`: this rank's attention forward and backward
    of the layer; `link(span)`: bytes/s per GPU of a group of `span` consecutive ranks."""
    cp, comm = sh.cp, sh.cp_comm
    if cp == 1:
        return 0.0
    kv = kv_bytes(sh)
    fwd = bwd = 0.0
    ring = cp // sh.a2a if comm in ("p2p", "a2a+p2p") else 1
    if ring > 1:  # each of ring-1 sends overlaps one step's block of attention
        bw = link(sh.tp * cp)
        fwd += (ring - 1) * max(0.0, kv / bw - attn_s[0] / ring)
        bwd += (ring - 1) * max(0.0, 2 * kv / bw - attn_s[1] / ring)
    if comm == "all_gather":  # gather (forward, backward), reduce-scatter dK/dV: not overlapped
        bw = link(sh.tp * cp)
        regather = sh.impl != "local"  # the CPU's autograd gather keeps K/V: no second gather
        fwd += (cp - 1) * kv / bw
        bwd += (1 + regather) * (cp - 1) * kv / bw
    if sh.a2a > 1:  # q, k, v in and the output back; their gradients the other way
        n = sh.a2a
        vol = (n - 1) / n * sh.tokens * (2 * sh.q + 2 * sh.kv) / sh.tp * sh.ab
        bw = link(sh.tp * n)
        fwd += vol / bw
        bwd += vol / bw
    return fwd * (2 if recompute_full else 1) + bwd
