"""FLOPs: the model FLOPs that MFU is quoted in, and the work one GPU executes per micro-batch.

Model FLOPs per token follow the published convention (tests/data/published_throughput.csv):
N' = parameters without the input embedding (the LM head counts);
- full training: 6N' + the causal attention term 6 * seq_len * (heads * head_dim) per layer
  (forward QK^T and AV over seq_len/2 keys on average, backward twice that);
- LoRA: 4N' (forward and input gradients of the frozen base; adapters and attention not counted).
A mixture of experts counts its active parameters in N': each MoE layer's router and top-k
experts (Megatron-Bridge's MoE rows reproduce as this to 0.1%: tests/unit/planner/test_fit.py).
Executed work is what the time model needs: GEMMs by precision, attention (flash backward
recomputes QK^T: 2.5x its forward), recompute, the LM head and the last layer's MLP (and on CPU
its attention's queries and output projection) at the target positions (plan.target_fraction); it
differs from model FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from ftcore.planner import mla
from ftcore.planner.activations import (
    MLP_LINEARS,
    moe_tokens,
    reference_forwards,
    rows_per_item,
    shape_of,
)
from ftcore.planner.layers import split_for
from ftcore.planner.params import (
    expert_shapes,
    linear_shapes,
    lora_params,
    lora_plan,
    moe_layer,
    moe_layer_count,
    padded_vocab,
    shared_shapes,
)
from ftcore.planner.view import memo

FLASH_BWD = 2.5  # flash-attention backward work relative to its forward


def n_prime(cfg: DictConfig) -> int:
    """Base-model parameters without the input embedding (the LM head counts); a MoE layer's
    router and top-k experts in place of a dense MLP."""
    m = cfg.model
    lin = sum(o * i for o, i in linear_shapes(m, 1).values())
    n = m.num_layers * (lin + 2 * m.hidden_size) + m.hidden_size + m.vocab_size * m.hidden_size
    n_moe = moe_layer_count(m)
    if n_moe:
        dense = sum(o * i for k, (o, i) in linear_shapes(m, 1).items() if k in MLP_LINEARS)
        routed = m.moe_router_topk * sum(o * i for o, i in expert_shapes(m, 1).values())
        shared = sum(o * i for o, i in shared_shapes(m, 1).values())  # every token's
        n += n_moe * (m.num_experts * m.hidden_size + routed + shared - dense)
    return n


def head_width(m) -> float:
    """The head width of the attention FLOPs: q.k and the weighted values over it, each a
    [s, d] x [d, s] per head; MLA's q/k heads (nope + rope) and value heads differ: their mean."""
    if mla.is_mla(m):
        qk, v = mla.head_dims(m)
        return (qk + v) / 2
    return m.kv_channels or m.hidden_size // m.num_attention_heads


def attention_flops_per_token(cfg: DictConfig) -> float:
    """Causal attention, forward + backward, per token, all layers (model-FLOPs convention)."""
    m = cfg.model
    return 6.0 * cfg.data.seq_len * m.num_attention_heads * head_width(m) * m.num_layers


def model_flops_per_token(cfg: DictConfig) -> float:
    """objective=dpo adds the reference's forward: 2N' + a third of the attention term."""
    ref = reference_forwards(cfg) * (2.0 * n_prime(cfg) + attention_flops_per_token(cfg) / 3)
    if cfg.peft.name in ("lora", "qlora"):
        return 4.0 * n_prime(cfg) + ref
    return 6.0 * n_prime(cfg) + attention_flops_per_token(cfg) + ref


def attention_forward_flops(cfg: DictConfig) -> float:
    """One layer's causal attention forward on one GPU, one micro-batch: its seq_len/cp queries
    (2*cp load-balanced chunks) against keys over half the sequence on average, its heads/tp. The
    CPU's local spec computes every score, masked: twice that."""
    m, p = cfg.model, cfg.parallel
    d = head_width(m)
    tokens = cfg.data.seq_len // p.cp * cfg.train.micro_batch_size * rows_per_item(cfg)
    fwd = 2.0 * tokens * cfg.data.seq_len * m.num_attention_heads * d / p.tp
    return fwd * (2 if cfg.cluster.device == "cpu" else 1)


@dataclass
class Work:
    """FLOPs one GPU of a pipeline rank executes for one micro-batch."""

    gemm_quant: float = 0.0  # in the FP8/FP4 recipe's precision
    gemm_base: float = 0.0  # in params_dtype (LM head, first/last bf16 layers, adapters)
    attention: float = 0.0
    layers: int = 0
    moe_layers: int = 0  # of them, layers with routed experts
    expert_quant: float = 0.0  # of gemm_quant, the routed experts' GEMMs
    expert_base: float = 0.0  # of gemm_base, the routed experts' GEMMs


def _moe_layer_flops(cfg, shapes, adapters_of, passes: int) -> tuple[float, float, float]:
    """(GEMM FLOPs, adapter FLOPs, of the GEMM FLOPs the experts') of one MoE layer on the busiest EP rank, one micro-batch:
    attention linears over its tokens, the router over the tokens it routes, its experts over the
    routed copies it receives (activations.moe_tokens: top-k x the imbalance assumed)."""
    m, p = cfg.model, cfg.parallel
    if not moe_layer_count(m):
        return 0.0, 0.0, 0.0
    sh = shape_of(cfg)
    tm, routed = moe_tokens(sh)
    etp = getattr(p, "etp", 1) or 1
    attn = sum(o * i for k, (o, i) in shapes.items() if k not in MLP_LINEARS)
    expert = sum(o * i for o, i in expert_shapes(m, etp).values())
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    plan = lora_plan(cfg)
    expert_ad = sum(
        n
        for t, sl in plan.items()
        if t in MLP_LINEARS
        for _, n in lora_params(m, t, sl, cfg.peft.r, etp, f)
    )
    attn_ad = sum(n for t, n in adapters_of.items() if t not in MLP_LINEARS)
    experts = 2.0 * passes * routed * expert
    shared = sum(o * i for o, i in shared_shapes(m, p.tp).values())  # every token, split over TP
    attn += shared
    sf = getattr(m, "moe_shared_expert_ffn_hidden_size", None)
    attn_ad += sum(n for t, sl in plan.items() if t in MLP_LINEARS and sf
                   for _, n in lora_params(m, t, sl, cfg.peft.r, p.tp, sf))  # fmt: skip
    gemm = 2.0 * passes * (sh.tokens * attn + tm * m.num_experts * m.hidden_size) + experts
    extra = 3 + (1 if p.recompute == "full" else 0)
    return gemm, 2.0 * extra * (sh.tokens * attn_ad + routed * expert_ad), experts


def micro_batch_work(cfg: DictConfig, pp_rank: int) -> Work:
    """What one GPU of a pipeline rank executes for one micro-batch (read-only: memoised)."""
    return memo(cfg, ("work", pp_rank), lambda: _micro_batch_work(cfg, pp_rank))


def _micro_batch_work(cfg: DictConfig, pp_rank: int) -> Work:
    m, p = cfg.model, cfg.parallel
    tp = p.tp
    tokens = cfg.data.seq_len // p.cp * cfg.train.micro_batch_size * rows_per_item(cfg)
    full = cfg.peft.name == "none"
    recompute_fwd = 1 if p.recompute == "full" else 0
    ref = reference_forwards(cfg)  # DPO's reference forward (base GEMMs, attention, LM head)
    # forward, dgrad, (wgrad), (recomputed forward), (the reference's forward)
    passes = (3 if full else 2) + recompute_fwd + ref
    shapes = linear_shapes(m, tp)
    lin = sum(o * i for o, i in shapes.values())
    adapters_of = {  # adapter parameters per linear
        t: sum(n for _, n in lora_params(m, t, sl, cfg.peft.r, tp))
        for t, sl in lora_plan(cfg).items()
    }
    adapters = sum(adapters_of.values())
    split = split_for(cfg)
    offsets = split.offsets[pp_rank]
    quant = bool(cfg.precision.fp8_recipe or cfg.precision.fp4_recipe)
    keep = cfg.precision.first_last_bf16_layers
    w = Work(layers=sum(split[pp_rank]))
    moe_flops, moe_adapter_flops, expert_flops = _moe_layer_flops(cfg, shapes, adapters_of, passes)
    for v, n in enumerate(split[pp_rank]):
        for layer in range(offsets[v], offsets[v] + n):
            flops = 2.0 * tokens * lin * passes
            ad = 2.0 * tokens * adapters * (3 + recompute_fwd)
            if moe_layer(m, layer):
                flops, ad = moe_flops, moe_adapter_flops
                w.moe_layers += 1
            experts = expert_flops if moe_layer(m, layer) else 0.0
            if quant and keep <= layer < m.num_layers - keep:
                w.gemm_quant += flops
                w.expert_quant += experts
            else:
                w.gemm_base += flops
                w.expert_base += experts
            w.gemm_base += ad
    fwd = attention_forward_flops(cfg)
    modules = getattr(p, "recompute_modules", ["core_attn"]) if p.recompute == "selective" else []
    attn_again = p.recompute == "full" or "core_attn" in modules
    w.attention = fwd * (1 + FLASH_BWD + (1 if attn_again else 0) + ref) * w.layers
    if "mlp" in modules:  # selective MLP recompute: fc1, fc2 (and their adapters) run forward twice
        mlp = 2.0 * tokens * sum(o * i for k, (o, i) in shapes.items() if k in MLP_LINEARS)
        if quant:
            w.gemm_quant += mlp * w.layers  # the first/last bf16 layers' share is counted here too
        else:
            w.gemm_base += mlp * w.layers
        w.gemm_base += 2.0 * tokens * sum(adapters_of.get(k, 0) for k in MLP_LINEARS) * w.layers
    if pp_rank == p.pp - 1:
        # logits and the last layer's MLP (and attention's queries on, where it picks) at the
        # target positions only (models/target_logits.py)
        sh = shape_of(cfg)
        head = 2.0 * sh.target_tokens * padded_vocab(m.vocab_size, tp) // tp * m.hidden_size
        w.gemm_base += head * ((3 if full else 2) + ref)
        if sh.mlp_picks and split[pp_rank][-1] > 0:
            skipped = 1 - sh.target_tokens / sh.tokens
            picked = MLP_LINEARS + (("linear_proj",) if sh.attn_picks else ())
            lin_picked = sum(o * i for k, (o, i) in shapes.items() if k in picked)
            ad = sum(adapters_of.get(k, 0) for k in picked)
            w.gemm_base -= skipped * 2.0 * tokens * (lin_picked * passes + ad * (3 + recompute_fwd))
            if sh.attn_picks:
                w.attention -= skipped * fwd * (1 + FLASH_BWD)
    return w
