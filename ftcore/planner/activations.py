"""Activation bytes: what autograd saves for backward, per layer part, and how many micro-batches
are in flight on each pipeline rank.

Two implementations are modelled, because they save different tensors:
- `local`: megatron's local layer spec (CPU runs) with torch SDPA as core attention (no
  [b, heads, s, s] softmax kept, but an additive mask per layer), ftcore's RMSNorm and SwiGLU
  functions (input and rstd; fc1 output and silu(gate)), frozen linears keep no input.
  Under context parallelism its attention all-gathers K and V: SDPA keeps them for the whole
  sequence, per layer.
- `te`: Transformer Engine's spec (GPU runs): flash attention (q, k, v, output, logsumexp), fused
  LayerNorm-Linear (input, rstd, normed output), fused SwiGLU (its input); FP8 linears keep their
  inputs quantized (1 byte).
The `local` numbers are checked against tensors counted with saved_tensors_hooks in
tests/multiproc/test_planner_bytes*.py; the `te` ones follow the same accounting for TE's modules.

A mixture-of-experts layer (moe_parts) keeps the router's input and routing and, for the routed
token copies this EP rank receives, the experts' fc1 input, weighted SwiGLU input and fc2 input
(measured on CPU where all copies stay on the rank). With ep > 1 the busiest rank receives
`routed` x the mean: plan.moe_imbalance (dropless, assumed) or moe.capacity_factor (the bound a
capacity puts on an expert).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from ftcore.planner import cp, mla
from ftcore.planner.layers import split_for
from ftcore.planner.params import is_moe, lora_plan, moe_layer_count, padded_vocab
from ftcore.planner.view import memo

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Shape:
    """Everything the activation formulas need, resolved from the config."""

    s: int  # full sequence length
    sl: int  # local sequence (s / cp)
    b: int  # micro batch
    h: int
    q: int  # heads * head dim
    kv: int  # kv groups * head dim
    f: int  # ffn hidden
    a: int  # heads
    g: int  # kv groups
    d: int  # head dim
    vocab: int  # padded vocab
    tp: int
    sp: bool
    ab: int  # activation bytes
    fp8: bool  # linear inputs kept quantized (TE)
    impl: str  # local | te
    full: bool  # base trainable
    targets: tuple[str, ...]  # linears with LoRA adapters
    lora_a: tuple[tuple[str, int], ...]  # (linear, number of A matrices)
    r: int
    recompute: str
    targets_frac: float = 1.0  # positions the last stage computes logits at (target_logits.py)
    mlp_picks: bool = False  # the last layer's MLP runs at those positions only
    attn_picks: bool = False  # and its attention's queries and output projection (local spec)
    cp: int = 1
    cp_comm: str = "p2p"  # parallel.cp_comm_type (cp.py)
    a2a: int = 1  # CP ranks one all-to-all spans
    recompute_modules: tuple[str, ...] = ("core_attn",)  # what selective recompute recomputes
    moe: bool = False  # routed experts in (some) layers
    dense_layers: bool = True  # some layers have a dense MLP
    experts: int = 0
    topk: int = 0
    fe: int = 0  # an expert's ffn width
    etp: int = 1
    routed: float = 1.0  # the busiest EP rank's routed tokens over the mean
    local_experts: int = 0  # experts per EP rank
    shared_f: int = 0  # the shared experts' total width (DeepSeek-V3, GLM-4.5)
    latent: int = 0  # MLA: q_lora + kv_lora, the latents its norms keep (planner/mla.py)
    rope_k: int = 0  # MLA: the rotary key's width, gathered for every head

    def recomputes(self, module: str) -> bool:
        """Selective recompute of `module` (core_attn | mlp | layernorm): parallel.recompute_modules."""
        return self.recompute == "selective" and module in self.recompute_modules

    @property
    def target_tokens(self) -> int:
        return max(1, round(self.tokens * self.targets_frac))

    @property
    def tokens(self) -> int:
        return self.sl * self.b

    @property
    def expert_elems(self) -> int:
        """One expert weight's elements on a rank (hidden x width / etp): its GEMMs' size."""
        return self.h * self.fe // self.etp

    @property
    def hs(self) -> int:
        """Hidden width of tensors outside the TP region on one rank (split by SP)."""
        return self.h // self.tp if self.sp else self.h


def _dpo(cfg) -> bool:
    o = getattr(cfg, "objective", None)
    return o is not None and o.name == "dpo"


def rows_per_item(cfg) -> int:
    """objective=dpo unpacked: train.micro_batch_size counts pairs, each two rows (chosen,
    rejected); packed, it counts rows, each holding whole pairs."""
    return 2 if _dpo(cfg) and not cfg.data.packing else 1


def reference_forwards(cfg) -> int:
    """objective=dpo: one forward of the reference per micro-batch, before the policy's; none
    with objective.precompute_ref (a one-time pass before training, not priced per step)."""
    return 1 if _dpo(cfg) and not getattr(cfg.objective, "precompute_ref", False) else 0


def shape_of(cfg: DictConfig, micro_batch: int | None = None) -> Shape:
    return memo(cfg, ("shape", micro_batch), lambda: _shape_of(cfg, micro_batch))


def _shape_of(cfg: DictConfig, micro_batch: int | None) -> Shape:
    m, p, pr = cfg.model, cfg.parallel, cfg.precision
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    q, kv, groups, latent = (
        m.num_attention_heads * d,
        m.num_query_groups * d,
        m.num_query_groups,
        {},
    )
    if mla.is_mla(m):  # q and k heads of nope + rope, v heads of v: kv is half of k + v
        qk, v = mla.head_dims(m)
        d, groups = qk, m.num_attention_heads
        q, kv = groups * qk, groups * (qk + v) // 2
        latent = {"latent": mla.latent_norms(m), "rope_k": int(m.qk_rope_head_dim)}
    te = cfg.cluster.device != "cpu"
    quant = bool(pr.fp8_recipe or pr.fp4_recipe)
    picks = True  # models/target_logits.py: applies() (a CP rank picks its own rows); not SP
    mlp_picks = picks and not p.sp and p.recompute != "full" and not quant
    targets_frac = min(1.0, float(cfg.plan.target_fraction)) if picks else 1.0
    comm = cp.comm_type(p) if te else "all_gather"  # the CPU runtime's one CP attention
    moe = moe_fields(cfg)
    return Shape(
        s=cfg.data.seq_len,
        sl=cfg.data.seq_len // p.cp,
        b=(micro_batch or cfg.train.micro_batch_size) * rows_per_item(cfg),
        h=m.hidden_size,
        q=q,
        kv=kv,
        f=m.ffn_hidden_size,
        a=m.num_attention_heads,
        g=groups,
        d=d,
        vocab=padded_vocab(m.vocab_size, p.tp),
        tp=p.tp,
        sp=bool(p.sp),
        ab=DTYPE_BYTES[pr.params_dtype],
        fp8=te and quant,
        impl="te" if te else "local",
        full=cfg.peft.name == "none",
        targets=tuple(lora_plan(cfg)),
        lora_a=tuple((k, len(set(v.values()))) for k, v in lora_plan(cfg).items()),
        r=cfg.peft.r,
        recompute=p.recompute,
        targets_frac=targets_frac,
        mlp_picks=mlp_picks,
        # SdpaAttention serves the rows only when they are at most half the slots (attention.py)
        # (the CP attention, models/local/cp_attention.py, attends every local row)
        attn_picks=mlp_picks
        and not te
        and p.recompute == "none"
        and 2 * targets_frac <= 1.0
        and p.cp == 1,
        cp=p.cp,
        cp_comm=comm,
        a2a=cp.a2a_size(
            m, p.tp, p.cp, comm, cfg.cluster.nvlink_domain or 1, cp.hierarchical_sizes(p)
        ),
        recompute_modules=tuple(getattr(p, "recompute_modules", ("core_attn",))),
        **moe,
        **latent,
    )


def routed_factor(cfg) -> float:
    """The busiest EP rank's routed tokens over the mean: the capacity factor where one bounds
    each expert, else plan.moe_imbalance (dropless: an assumption, docs/planner.md)."""
    cap = getattr(getattr(cfg, "moe", None), "capacity_factor", None)
    if cap:
        return float(cap)
    return float(getattr(cfg.plan, "moe_imbalance", 1.0) or 1.0)


def moe_fields(cfg) -> dict:
    m, p = cfg.model, cfg.parallel
    if not is_moe(m):
        return {}
    return dict(
        moe=True,
        dense_layers=moe_layer_count(m) < m.num_layers,
        experts=m.num_experts,
        topk=m.moe_router_topk,
        fe=m.moe_ffn_hidden_size or m.ffn_hidden_size,
        etp=getattr(p, "etp", 1) or 1,
        routed=routed_factor(cfg),
        local_experts=m.num_experts // (getattr(p, "ep", 1) or 1),
        shared_f=int(getattr(m, "moe_shared_expert_ffn_hidden_size", None) or 0),
    )


def moe_tokens(sh: Shape) -> tuple[int, float]:
    """(tokens entering the router on this rank, routed copies it receives on the busiest rank).
    Under SP a TP rank routes its own tokens; etp > 1 gathers its group's copies."""
    tm = sh.tokens // sh.tp if sh.sp else sh.tokens
    return tm, tm * sh.topk * sh.etp * sh.routed


def moe_parts(sh: Shape) -> dict[str, int]:
    """Saved bytes of a MoE layer's MLP side for one micro-batch (replacing MLP_PARTS), as
    megatron-core 0.16.1 saves them: the pre-MLP norm's input and rstd; the router's input in
    fp32, the top-k indices (int64) and probabilities, the [experts, tokens] routing map and
    probabilities the permutation keeps, the permuted copies' int64 order; per routed copy the
    experts' fc1 input, the input of the SwiGLU that applies the routing probability (and that
    probability) and fc2's input. The combine keeps no activation (the probabilities were applied
    in the experts)."""
    tm, r = moe_tokens(sh)
    ab, h, f, k, e = sh.ab, sh.h, sh.fe // sh.etp, sh.topk, sh.experts
    lin_b = 1 if sh.fp8 else ab
    T, sf = sh.tokens, sh.shared_f // sh.tp  # the shared experts: a dense MLP of their width
    keeps = sh.full or "linear_fc1" in sh.targets
    return {
        "shared": (T * sh.hs * lin_b if keeps else 0) + 3 * T * sf * ab + T * sf * lin_b
        if sf
        else 0,
        "mlp_norm": tm * h * ab + tm * 4,
        "router": tm * h * 4 + tm * k * (8 + 4) + tm * e * (1 + 4) + tm * k * 8,
        "fc1": round(r * h * lin_b) if sh.full or "linear_fc1" in sh.targets else 0,
        "swiglu": round(r * 2 * f * ab + r * 4),
        "fc2": round(r * f * lin_b) if sh.full or "linear_fc2" in sh.targets else 0,
    }


def _keeps_input(sh: Shape, linear: str) -> bool:
    """A linear's input is saved when its weight trains or an adapter reads it."""
    return sh.full or linear in sh.targets


def layer_parts(sh: Shape) -> dict[str, int]:
    """Saved bytes of one transformer layer for one micro-batch, by layer part (no recompute)."""
    T, t, ab = sh.tokens, sh.tp, sh.ab
    hs = sh.hs
    lin_b = 1 if sh.fp8 else ab  # bytes of a saved linear input
    parts: dict[str, int] = {}
    if sh.impl == "local":
        # ftcore RMSNorm (models/norm.py): its input as it is, and the fp32 rstd.
        norm = T * hs * ab + T * 4
        parts["attn_norm"] = norm
        parts["qkv"] = T * hs * ab if _keeps_input(sh, "linear_qkv") else 0
        parts["rope"] = 4 * sh.sl * sh.d * ab
        # SDPA (models/attention.py) keeps q, k (rotated copies) and v (a view of the fused QKV
        # output) as they are, its output, the fp32 logsumexp and the mask as an additive
        # [b, 1, s, s] tensor in the activation dtype.
        qkv_saved = T * (sh.q + sh.kv) // t * ab + T * (sh.q + 2 * sh.kv) // t * ab
        if sh.cp > 1:  # all-gather attention: the rotated local queries, K/V of the whole sequence
            qkv_saved = T * sh.q // t * ab + sh.b * sh.s * 2 * sh.kv // t * ab
        parts["core_attn"] = qkv_saved + (0 if sh.recomputes("core_attn") else _sdpa(sh))
        parts["proj"] = T * sh.q // t * ab if _keeps_input(sh, "linear_proj") else 0
        parts["mlp_norm"] = norm
        parts["fc1"] = T * hs * ab if _keeps_input(sh, "linear_fc1") else 0
        parts["swiglu"] = 3 * T * sh.f // t * ab  # fc1 output (gate, up), silu(gate): swiglu.py
        parts["fc2"] = T * sh.f // t * ab if _keeps_input(sh, "linear_fc2") else 0
    else:
        # TE LayerNormLinear: input, rstd, normalised output (quantized under FP8).
        def ln_linear(linear: str) -> int:
            return T * hs * ab + T * 4 + (T * hs * lin_b if _keeps_input(sh, linear) else 0)

        parts["attn_norm"] = 0
        parts["qkv"] = ln_linear("linear_qkv")
        parts["rope"] = 0
        lse = sh.b * (sh.a // t) * sh.sl * 4
        qkv = T * (sh.q + 2 * sh.kv) // t * ab
        out = T * sh.q // t * ab
        parts["core_attn"] = qkv + (0 if sh.recomputes("core_attn") else out + lse)
        proj_in = T * sh.q // t * (1 if sh.fp8 else 0)  # bf16: the attention output itself
        if sh.recomputes("core_attn") and not sh.fp8:
            proj_in = T * sh.q // t * ab
        parts["proj"] = proj_in if _keeps_input(sh, "linear_proj") else 0
        parts["mlp_norm"] = 0
        parts["fc1"] = ln_linear("linear_fc1")
        parts["swiglu"] = 2 * T * sh.f // t * ab
        parts["fc2"] = T * sh.f // t * lin_b if _keeps_input(sh, "linear_fc2") else 0
    if sh.latent:  # MLA: the latents around their norms, the rotary key for every head
        parts["latent"] = hs * T // sh.h * (2 * sh.latent * ab + 8) + T * sh.rope_k * ab
    # Adapters keep A·x for B's gradient: [s, b, r] per A after the column gather, [s(/tp), b, r]
    # after the row reduction.
    lora = [(module, n_a) for module, n_a in sh.lora_a]
    if sh.recomputes("mlp"):  # the MLP keeps only its input; fc1/fc2 adapters recompute too
        parts.update(mlp_norm=0, fc1=T * hs * ab, swiglu=0, fc2=0)
        lora = [(module, n_a) for module, n_a in lora if module not in MLP_LINEARS]
    parts["lora"] = sum(_lora_saved(sh, module, n_a) for module, n_a in lora) * ab
    return parts


def _sdpa(sh: Shape) -> int:
    """The local spec's SDPA: its output, the fp32 logsumexp, the additive mask."""
    return (
        sh.tokens * sh.q // sh.tp * sh.ab
        + sh.b * (sh.a // sh.tp) * sh.sl * 4
        + sh.b * sh.sl * sh.s * sh.ab
    )


def _lora_saved(sh: Shape, module: str, n_a: int) -> int:
    if module in ("linear_qkv", "linear_fc1"):
        return sh.tokens * sh.r * n_a
    return sh.tokens * sh.r // (sh.tp if sh.sp else 1)


MLP_PARTS = ("mlp_norm", "fc1", "swiglu", "fc2")
MLP_LINEARS = ("linear_fc1", "linear_fc2")


def last_layer_saving(sh: Shape) -> int:
    """Bytes the last layer does not save when it runs at the target positions only: its MLP and,
    where its attention picks too, the rotated queries, SDPA's output, logsumexp and mask rows and
    the output projection's input (keys and values stay at every position)."""
    if not sh.mlp_picks:  # never under full recompute
        return 0
    parts = layer_parts(sh)
    picked = sum(parts[k] for k in MLP_PARTS)
    linears = MLP_LINEARS + (("linear_proj",) if sh.attn_picks else ())
    if sh.moe and not sh.dense_layers:  # the MoE block runs at those positions
        mlp = moe_layer_parts(sh)
        picked = sum(mlp.get(k, 0) for k in (*MLP_PARTS, "router", "expert_lora"))
        linears = ("linear_proj",) if sh.attn_picks else ()
    picked += sum(_lora_saved(sh, k, n) for k, n in sh.lora_a if k in linears) * sh.ab
    if sh.attn_picks:
        picked += sh.tokens * sh.q // sh.tp * sh.ab + _sdpa(sh) + parts["proj"]
    return round(picked * (1 - sh.target_tokens / sh.tokens))


def layer_bytes(sh: Shape) -> int:
    """Saved bytes per layer per micro-batch, after recompute. A MoE model counts its MoE layer
    (the larger of it and a dense one where both kinds exist: an upper bound)."""
    if sh.recompute == "full":
        return sh.tokens * sh.hs * sh.ab  # only the layer input is checkpointed
    dense = sum(layer_parts(sh).values())
    if not sh.moe:
        return dense
    moe = sum(moe_layer_parts(sh).values())
    return max(dense, moe) if sh.dense_layers else moe


def moe_layer_parts(sh: Shape) -> dict[str, int]:
    """A MoE layer's parts: the attention side of layer_parts, the MLP side of moe_parts."""
    parts = {k: v for k, v in layer_parts(sh).items() if k not in MLP_PARTS}
    tm, r = moe_tokens(sh)
    attn_lora = [(k, n) for k, n in sh.lora_a if k not in MLP_LINEARS]
    parts["lora"] = sum(_lora_saved(sh, k, n) for k, n in attn_lora) * sh.ab
    if sh.recomputes("mlp"):  # the MoE block keeps its input only
        return {**parts, "mlp": tm * sh.h * sh.ab}
    expert_lora = sum(round(r * sh.r * n) for k, n in sh.lora_a if k in MLP_LINEARS) * sh.ab
    return {**parts, **moe_parts(sh), "expert_lora": expert_lora}


def loss_bytes(sh: Shape) -> dict[str, int]:
    """Last stage: final norm, output-layer input, the cross entropy's fp32 softmax (at the target
    positions only, and the final norm too when the last MLP picked them)."""
    T = sh.target_tokens if sh.mlp_picks else sh.tokens
    norm = T * sh.hs * sh.ab + T * 4  # ftcore's RMSNorm and TE's alike: input and rstd
    head_in = sh.target_tokens * sh.h * sh.ab if sh.full else 0  # gathered under SP, then picked
    return {
        "final_norm": norm,
        "output_layer": head_in,
        "loss": sh.target_tokens * sh.vocab // sh.tp * 4,
    }


def logits_transient(sh: Shape) -> int:
    """Last stage, at the loss: the logits and their fp32 copy live beside the saved softmax."""
    return sh.target_tokens * sh.vocab // sh.tp * (sh.ab + 4)


def recompute_transient(sh: Shape) -> int:
    """Full recompute: one layer's activations exist again while its backward runs."""
    if sh.recompute != "full":
        return 0
    return layer_bytes(Shape(**{**sh.__dict__, "recompute": "none"}))


def in_flight_layers(cfg: DictConfig, pp_rank: int, num_micro: int) -> tuple[int, int]:
    """(layer-microbatches held at the peak, micro-batch inputs held) on one pipeline rank.

    1F1B: rank r holds min(pp - r, m) micro-batches of all its layers. Interleaved: megatron's
    warm-up runs (pp - r - 1) * 2 + (vp - 1) * pp forwards, chunk (k // pp) % vp for the k-th,
    before the first backward; each holds that chunk's layers.
    """
    p = cfg.parallel
    split = split_for(cfg)
    layers = split[pp_rank]
    if p.pp == 1:
        return sum(layers), 0
    if p.vp == 1:
        n = min(p.pp - pp_rank, num_micro)
        return n * layers[0], n
    total = num_micro * p.vp
    warm = min((p.pp - pp_rank - 1) * 2 + (p.vp - 1) * p.pp, total)
    units = [(k // p.pp) % p.vp for k in range(warm + 1)]
    return sum(layers[c] for c in units), len(units)
