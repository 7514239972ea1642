"""Declarative ftcore (megatron) <-> Hugging Face tensor mapping (Llama and the families of
config/families.py: Qwen2's q/k/v biases fuse like the weights, Qwen3's per-head q/k norms are
replicated [head_dim] weights).

Each rule names one megatron parameter (by its layout-independent global name, see
models/sharding.py), the HF tensors it is made of and how:
- `direct`: the same tensor (norms, o_proj, down_proj);
- `vocab`:  the same rows, padded with zero rows to the TP-padded vocab (embedding, lm_head);
- `qkv`:    megatron's fused `linear_qkv` (weight or bias), laid out per query group:
            [q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...];
- `glu`:    megatron's `linear_fc1` = [gate; up] (TP shards each half separately); `expert_glu`
            the same for one expert (its own width, moe_ffn, sharded over ETP); `shared_glu` for
            the shared experts (their total width, sharded over TP like a dense MLP).
Multi-head latent attention (DeepSeek-V3) maps one to one (`direct`): q_a/q_b (or q_proj),
kv_a_proj_with_mqa, kv_b_proj and o_proj are megatron's linear_q_down/up, linear_kv_down/up and
linear_proj, each split over TP by its own rows (columns for o_proj) as megatron splits it; the
latent norms are the local spec's q/kv_layernorm or TE's fused layer_norm_weight. The rotary rows
need no reordering: transformers' rope_interleave and megatron's MLA rotate the same pairs.
The expert bias `mlp.gate.e_score_correction_bias` is megatron's `mlp.router.expert_bias`, a
buffer (models/sharding.py iter_weights).
Mixture of experts: `{e}` is the global expert index (models/sharding.py names local experts by
it), and the HF names are the family's (EXPERT_NAMES: Qwen3-MoE `mlp.gate` / `mlp.experts.E.
{gate,up,down}_proj`, Mixtral `block_sparse_moe.gate` / `experts.E.{w1,w3,w2}`), the published
per-expert layout, which is also what transformers 5's save_pretrained writes.
`shard_pieces` says which rows/columns of which HF tensors make one TP rank's shard (so a rank reads
only those); `to_hf` / `from_hf` convert full tensors for export and tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ftcore.config.families import family
from ftcore.models.sharding import ShardInfo

L = "model.layers.{i}."


@dataclass(frozen=True)
class Rule:
    pattern: str  # ftcore global name; {i} = global layer index
    hf: tuple[str, ...]  # HF tensor names, in fused order
    kind: str  # direct | vocab | qkv | glu | expert_glu | shared_glu


RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule("decoder.layers.{i}.input_layernorm.weight", (L + "input_layernorm.weight",), "direct"),
    # Transformer Engine's spec fuses the norms into the next linear layer
    Rule("decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight", (L + "input_layernorm.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.linear_qkv.weight",
         (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"), "qkv"),
    Rule("decoder.layers.{i}.self_attention.linear_qkv.bias",
         (L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias"), "qkv"),
    Rule("decoder.layers.{i}.self_attention.q_layernorm.weight", (L + "{qnorm}",), "direct"),
    Rule("decoder.layers.{i}.self_attention.k_layernorm.weight", (L + "self_attn.k_norm.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.linear_proj.weight", (L + "self_attn.o_proj.weight",), "direct"),
    Rule("decoder.layers.{i}.pre_mlp_layernorm.weight", (L + "post_attention_layernorm.weight",), "direct"),
    Rule("decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight", (L + "post_attention_layernorm.weight",), "direct"),
    Rule("decoder.layers.{i}.mlp.linear_fc1.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), "glu"),
    Rule("decoder.layers.{i}.mlp.linear_fc2.weight", (L + "mlp.down_proj.weight",), "direct"),
    Rule("decoder.layers.{i}.mlp.router.weight", (L + "{router}",), "direct"),
    Rule("decoder.layers.{i}.mlp.router.expert_bias", (L + "mlp.gate.e_score_correction_bias",), "direct"),
    Rule("decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight",
         (L + "mlp.shared_experts.gate_proj.weight", L + "mlp.shared_experts.up_proj.weight"), "shared_glu"),
    Rule("decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight", (L + "mlp.shared_experts.down_proj.weight",), "direct"),
    # multi-head latent attention (DeepSeek-V3); the TE spec fuses the latent norms into the up
    # projections
    Rule("decoder.layers.{i}.self_attention.linear_q_proj.weight", (L + "self_attn.q_proj.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.linear_q_down_proj.weight", (L + "self_attn.q_a_proj.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.linear_q_up_proj.layer_norm_weight", (L + "self_attn.q_a_layernorm.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.linear_q_up_proj.weight", (L + "self_attn.q_b_proj.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.linear_kv_down_proj.weight", (L + "self_attn.kv_a_proj_with_mqa.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.kv_layernorm.weight", (L + "self_attn.kv_a_layernorm.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.linear_kv_up_proj.layer_norm_weight", (L + "self_attn.kv_a_layernorm.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.linear_kv_up_proj.weight", (L + "self_attn.kv_b_proj.weight",), "direct"),
    Rule("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight", (L + "{gate}", L + "{up}"), "expert_glu"),
    Rule("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight", (L + "{down}",), "direct"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "direct"),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab"),
)  # fmt: skip
_COMPILED = [
    (re.compile("^" + re.escape(r.pattern).replace(r"\{i\}", r"(\d+)").replace(r"\{e\}", r"(\d+)") + "$"), r)
    for r in RULES
]  # fmt: skip
TIED_HEAD = "model.embed_tokens.weight"
# the HF names of a MoE layer's router and expert {e}, per family (model.family)
EXPERT_NAMES = {
    "qwen3_moe": {"router": "mlp.gate.weight", "gate": "mlp.experts.{e}.gate_proj.weight",
                  "up": "mlp.experts.{e}.up_proj.weight", "down": "mlp.experts.{e}.down_proj.weight"},
    "mixtral": {"router": "block_sparse_moe.gate.weight", "gate": "block_sparse_moe.experts.{e}.w1.weight",
                "up": "block_sparse_moe.experts.{e}.w3.weight", "down": "block_sparse_moe.experts.{e}.w2.weight"},
}  # fmt: skip


@dataclass(frozen=True)
class Shapes:
    """The sizes the HF tensors must have, from cfg.model."""

    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    layers: int
    tie: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0  # MoE: experts per sparse layer (0 = dense)
    moe_ffn: int = 0  # one expert's hidden width
    dense_layers: tuple[int, ...] = ()  # MoE: layers with the dense MLP
    family: str = "llama"  # model.family: the experts' HF names (EXPERT_NAMES)
    shared_ffn: int = 0  # the shared experts' total width (0: none)
    expert_bias: bool = False  # e_score_correction_bias in every MoE layer
    mla: bool = False  # multi-head latent attention: the fields below; head_dim = nope + rope
    q_lora: int = 0  # 0: one q_proj
    kv_lora: int = 0
    rope_dim: int = 0
    v_dim: int = 0
    mtp_layers: int = 0  # multi-token-prediction layers after the last (copied, not mapped)

    @classmethod
    def from_cfg(cls, m) -> Shapes:
        f = family(m)
        experts = int(m.get("num_experts") or 0)
        moe_ffn = int(m.get("moe_ffn_hidden_size") or m.ffn_hidden_size) if experts else 0
        mla = {}
        if f.mla:
            mla = dict(mla=True, q_lora=int(m.q_lora_rank or 0), kv_lora=int(m.kv_lora_rank),
                       rope_dim=int(m.qk_rope_head_dim), v_dim=int(m.v_head_dim))  # fmt: skip
        return cls(m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
                   m.kv_channels or m.hidden_size // m.num_attention_heads, m.vocab_size, m.num_layers,
                   bool(m.tie_embeddings), f.qkv_bias, f.qk_layernorm, experts, moe_ffn,
                   tuple(int(i) for i in m.get("moe_dense_layers") or ()), f.name,
                   int(m.get("moe_shared_expert_ffn_hidden_size") or 0) if experts else 0,
                   bool(m.get("moe_router_expert_bias")) and experts > 0,
                   mtp_layers=int(m.get("mtp_layers") or 0), **mla)  # fmt: skip

    def sparse(self, layer: int) -> bool:
        return self.experts > 0 and layer not in self.dense_layers

    def expert_names(self) -> dict[str, str]:
        names = EXPERT_NAMES.get(self.family, EXPERT_NAMES["qwen3_moe"])
        return {**names, "qnorm": "self_attn.q_a_layernorm.weight" if self.mla
                else "self_attn.q_norm.weight"}  # fmt: skip


@dataclass(frozen=True)
class Mapped:
    """One megatron parameter resolved: its rule and the concrete HF names."""

    name: str
    rule: Rule
    hf: tuple[str, ...]


@dataclass(frozen=True)
class Piece:
    """Rows [r0, r1) and columns [c0, c1) of an HF tensor (None = all); hf=None: zero rows;
    `expert`: the index along a fused 3D experts tensor's first axis (hf/fused_experts.py)."""

    hf: str | None
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None
    expert: int | None = None


def resolve(name: str, tie: bool, s: Shapes | None = None) -> Mapped | None:
    """The rule for a megatron global parameter name, or None if no HF tensor maps to it (`s`
    names a MoE family's experts; default Qwen3-MoE's names)."""
    names = (s or Shapes(0, 0, 1, 1, 0, 0, 0, False)).expert_names()
    for rx, rule in _COMPILED:
        m = rx.match(name)
        if m:
            g = m.groups()
            hf = tuple(h.format(i=g[0], **names).format(e=g[1] if len(g) > 1 else 0) if g else h
                       for h in rule.hf)  # fmt: skip
            if rule.pattern == "output_layer.weight" and tie:
                hf = (TIED_HEAD,)
            return Mapped(name, rule, hf)
    return None


def hf_shape(hf_name: str, s: Shapes) -> tuple[int, ...]:
    """The full shape an HF tensor must have under cfg.model."""
    if s.mla and ".self_attn." in hf_name:
        return _mla_shape(hf_name, s)
    if hf_name.endswith("e_score_correction_bias"):
        return (s.experts,)
    if ".shared_experts." in hf_name:
        down = hf_name.endswith("down_proj.weight")
        return (s.hidden, s.shared_ffn) if down else (s.shared_ffn, s.hidden)
    if hf_name.endswith(("q_norm.weight", "k_norm.weight")):
        return (s.head_dim,)
    if hf_name.endswith("norm.weight"):
        return (s.hidden,)
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (s.vocab, s.hidden)
    if hf_name.endswith(".gate.weight"):  # a MoE router
        return (s.experts, s.hidden)
    if ".experts." in hf_name:
        down = hf_name.endswith(("down_proj.weight", "w2.weight"))
        return (s.hidden, s.moe_ffn) if down else (s.moe_ffn, s.hidden)
    suffix = hf_name.rsplit(".", 2)[-2]
    if hf_name.endswith(".bias"):
        return {"q_proj": (s.heads * s.head_dim,), "k_proj": (s.groups * s.head_dim,),
                "v_proj": (s.groups * s.head_dim,)}[suffix]  # fmt: skip
    return {
        "q_proj": (s.heads * s.head_dim, s.hidden),
        "k_proj": (s.groups * s.head_dim, s.hidden),
        "v_proj": (s.groups * s.head_dim, s.hidden),
        "o_proj": (s.hidden, s.heads * s.head_dim),
        "gate_proj": (s.ffn, s.hidden),
        "up_proj": (s.ffn, s.hidden),
        "down_proj": (s.hidden, s.ffn),
    }[suffix]


def _mla_shape(hf_name: str, s: Shapes) -> tuple[int, ...]:
    """The attention tensors of MLA (head_dim: the q/k head, nope + rope)."""
    suffix = hf_name.rsplit(".", 2)[-2]
    return {
        "q_proj": (s.heads * s.head_dim, s.hidden),
        "q_a_proj": (s.q_lora, s.hidden),
        "q_a_layernorm": (s.q_lora,),
        "q_b_proj": (s.heads * s.head_dim, s.q_lora),
        "kv_a_proj_with_mqa": (s.kv_lora + s.rope_dim, s.hidden),
        "kv_a_layernorm": (s.kv_lora,),
        "kv_b_proj": (s.heads * (s.head_dim - s.rope_dim + s.v_dim), s.kv_lora),
        "o_proj": (s.hidden, s.heads * s.v_dim),
    }[suffix]


def attention_names(s: Shapes, p: str) -> list[str]:
    """The attention tensors of layer prefix `p` (MLA's or q/k/v/o with the family's extras)."""
    if s.mla:
        q = ["q_a_proj", "q_a_layernorm", "q_b_proj"] if s.q_lora else ["q_proj"]
        return [p + f"self_attn.{x}.weight"
                for x in (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")]  # fmt: skip
    names = []
    for x in ("q", "k", "v"):
        names.append(p + f"self_attn.{x}_proj.weight")
        if s.qkv_bias:
            names.append(p + f"self_attn.{x}_proj.bias")
    if s.qk_norm:
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names + [p + "self_attn.o_proj.weight"]


def hf_names(s: Shapes) -> list[str]:
    """Every HF tensor of the model, in the order export writes them."""
    names = ["model.embed_tokens.weight"]
    for i in range(s.layers):
        p = L.format(i=i)
        names += [p + "input_layernorm.weight", *attention_names(s, p)]
        names += [p + "post_attention_layernorm.weight"]
        if s.sparse(i):
            x = s.expert_names()
            names.append(p + x["router"])
            if s.expert_bias:
                names.append(p + "mlp.gate.e_score_correction_bias")
            for e in range(s.experts):
                names += [p + x[k].format(e=e) for k in ("gate", "up", "down")]
            if s.shared_ffn:
                names += [p + f"mlp.shared_experts.{k}.weight"
                          for k in ("gate_proj", "up_proj", "down_proj")]  # fmt: skip
        else:
            names += [
                p + "mlp.gate_proj.weight",
                p + "mlp.up_proj.weight",
                p + "mlp.down_proj.weight",
            ]
    names.append("model.norm.weight")
    if not s.tie:
        names.append("lm_head.weight")
    return names


def _span(n: int, tp: int, rank: int) -> tuple[int, int]:
    return (n // tp * rank, n // tp * (rank + 1))


def shard_pieces(mp: Mapped, info: ShardInfo, s: Shapes, tp_rank: int, tp: int) -> list[Piece]:
    """The pieces (concatenated along dim 0) that make this TP rank's shard of `mp`."""
    dim = info.partition_dim if tp > 1 else None
    kind = mp.rule.kind
    if kind == "direct":
        if dim is None:
            return [Piece(mp.hf[0])]
        n = info.full_shape[dim]
        span = _span(n, tp, tp_rank)
        return [Piece(mp.hf[0], rows=span)] if dim == 0 else [Piece(mp.hf[0], cols=span)]
    if kind == "vocab":
        r0, r1 = _span(info.full_shape[0], tp, tp_rank) if dim == 0 else (0, info.full_shape[0])
        real = (min(r0, s.vocab), min(r1, s.vocab))
        pieces = [Piece(mp.hf[0], rows=real)] if real[1] > real[0] else []
        if r1 > max(r0, s.vocab):
            pieces.append(Piece(None, rows=(0, r1 - max(r0, s.vocab))))
        return pieces
    if kind in ("glu", "expert_glu", "shared_glu"):
        ffn = {"glu": s.ffn, "expert_glu": s.moe_ffn, "shared_glu": s.shared_ffn}[kind]
        span = _span(ffn, tp, tp_rank) if dim == 0 else (0, ffn)
        return [Piece(mp.hf[0], rows=span), Piece(mp.hf[1], rows=span)]
    if kind == "qkv":
        g0, g1 = _span(s.groups, tp, tp_rank) if dim == 0 else (0, s.groups)
        per, d = s.heads // s.groups, s.head_dim
        pieces = []
        for g in range(g0, g1):
            pieces += [Piece(mp.hf[0], rows=(g * per * d, (g + 1) * per * d)),
                       Piece(mp.hf[1], rows=(g * d, (g + 1) * d)),
                       Piece(mp.hf[2], rows=(g * d, (g + 1) * d))]  # fmt: skip
        return pieces
    raise ValueError(kind)


def to_hf(mp: Mapped, full: torch.Tensor, s: Shapes) -> dict[str, torch.Tensor]:
    """A full (TP-joined, possibly vocab-padded) megatron tensor as its HF tensors."""
    kind = mp.rule.kind
    if kind == "direct":
        return {mp.hf[0]: full}
    if kind == "vocab":
        return {mp.hf[0]: full[: s.vocab]}
    if kind in ("glu", "expert_glu", "shared_glu"):
        gate, up = full.chunk(2, dim=0)
        return {mp.hf[0]: gate, mp.hf[1]: up}
    per, d = s.heads // s.groups, s.head_dim
    rest = tuple(full.shape[1:])  # () for the bias
    grouped = full.reshape(s.groups, (per + 2) * d, *rest)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return {mp.hf[0]: q.reshape(-1, *rest), mp.hf[1]: k.reshape(-1, *rest),
            mp.hf[2]: v.reshape(-1, *rest)}  # fmt: skip


def from_hf(
    mp: Mapped, tensors: dict[str, torch.Tensor], s: Shapes, padded_vocab: int
) -> torch.Tensor:
    """The full megatron tensor from its HF tensors (inverse of to_hf)."""
    kind = mp.rule.kind
    if kind == "direct":
        return tensors[mp.hf[0]]
    if kind == "vocab":
        t = tensors[mp.hf[0]]
        return torch.cat([t, t.new_zeros((padded_vocab - t.shape[0],) + tuple(t.shape[1:]))])
    if kind in ("glu", "expert_glu", "shared_glu"):
        return torch.cat([tensors[mp.hf[0]], tensors[mp.hf[1]]])
    per, d = s.heads // s.groups, s.head_dim
    rest = tuple(tensors[mp.hf[0]].shape[1:])  # () for the bias
    q = tensors[mp.hf[0]].reshape(s.groups, per * d, *rest)
    k = tensors[mp.hf[1]].reshape(s.groups, d, *rest)
    v = tensors[mp.hf[2]].reshape(s.groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)
