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
            the same for one expert (its own width, moe_ffn, sharded over ETP).
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
    kind: str  # direct | vocab | qkv | glu


RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule("decoder.layers.{i}.input_layernorm.weight", (L + "input_layernorm.weight",), "direct"),
    # Transformer Engine's spec fuses the norms into the next linear layer
    Rule("decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight", (L + "input_layernorm.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.linear_qkv.weight",
         (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"), "qkv"),
    Rule("decoder.layers.{i}.self_attention.linear_qkv.bias",
         (L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias"), "qkv"),
    Rule("decoder.layers.{i}.self_attention.q_layernorm.weight", (L + "self_attn.q_norm.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.k_layernorm.weight", (L + "self_attn.k_norm.weight",), "direct"),
    Rule("decoder.layers.{i}.self_attention.linear_proj.weight", (L + "self_attn.o_proj.weight",), "direct"),
    Rule("decoder.layers.{i}.pre_mlp_layernorm.weight", (L + "post_attention_layernorm.weight",), "direct"),
    Rule("decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight", (L + "post_attention_layernorm.weight",), "direct"),
    Rule("decoder.layers.{i}.mlp.linear_fc1.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), "glu"),
    Rule("decoder.layers.{i}.mlp.linear_fc2.weight", (L + "mlp.down_proj.weight",), "direct"),
    Rule("decoder.layers.{i}.mlp.router.weight", (L + "{router}",), "direct"),
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

    @classmethod
    def from_cfg(cls, m) -> Shapes:
        f = family(m)
        experts = int(m.get("num_experts") or 0)
        moe_ffn = int(m.get("moe_ffn_hidden_size") or m.ffn_hidden_size) if experts else 0
        return cls(m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
                   m.kv_channels or m.hidden_size // m.num_attention_heads, m.vocab_size, m.num_layers,
                   bool(m.tie_embeddings), f.qkv_bias, f.qk_layernorm, experts, moe_ffn,
                   tuple(int(i) for i in m.get("moe_dense_layers") or ()), f.name)  # fmt: skip

    def sparse(self, layer: int) -> bool:
        return self.experts > 0 and layer not in self.dense_layers

    def expert_names(self) -> dict[str, str]:
        return EXPERT_NAMES.get(self.family, EXPERT_NAMES["qwen3_moe"])


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
    names = s.expert_names() if s is not None else EXPERT_NAMES["qwen3_moe"]
    for rx, rule in _COMPILED:
        m = rx.match(name)
        if m:
            g = m.groups()
            hf = tuple(h.format(i=g[0], router=names["router"], gate=names["gate"], up=names["up"],
                                down=names["down"]).format(e=g[1] if len(g) > 1 else 0) if g else h
                       for h in rule.hf)  # fmt: skip
            if rule.pattern == "output_layer.weight" and tie:
                hf = (TIED_HEAD,)
            return Mapped(name, rule, hf)
    return None


def hf_shape(hf_name: str, s: Shapes) -> tuple[int, ...]:
    """The full shape an HF tensor must have under cfg.model."""
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


def hf_names(s: Shapes) -> list[str]:
    """Every HF tensor of the model, in the order export writes them."""
    names = ["model.embed_tokens.weight"]
    for i in range(s.layers):
        p = L.format(i=i)
        names += [p + "input_layernorm.weight"]
        for x in ("q", "k", "v"):
            names.append(p + f"self_attn.{x}_proj.weight")
            if s.qkv_bias:
                names.append(p + f"self_attn.{x}_proj.bias")
        if s.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight"]
        if s.sparse(i):
            x = s.expert_names()
            names.append(p + x["router"])
            for e in range(s.experts):
                names += [p + x[k].format(e=e) for k in ("gate", "up", "down")]
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
    if kind in ("glu", "expert_glu"):
        ffn = s.moe_ffn if kind == "expert_glu" else s.ffn
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
    if kind in ("glu", "expert_glu"):
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
    if kind in ("glu", "expert_glu"):
        return torch.cat([tensors[mp.hf[0]], tensors[mp.hf[1]]])
    per, d = s.heads // s.groups, s.head_dim
    rest = tuple(tensors[mp.hf[0]].shape[1:])  # () for the bias
    q = tensors[mp.hf[0]].reshape(s.groups, per * d, *rest)
    k = tensors[mp.hf[1]].reshape(s.groups, d, *rest)
    v = tensors[mp.hf[2]].reshape(s.groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)
