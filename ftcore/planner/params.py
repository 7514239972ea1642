"""Which parameters one rank holds: names, element counts, trainable or frozen, linear or not.

Derived from the model shapes and the layout alone (no torch), in megatron's registration order
(embedding, then per layer input norm, QKV, out projection, MLP norm, fc1, fc2, then final norm and
output layer), so the DDP buffer layout and its padding can be replayed exactly in `memory.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from ftcore.planner.layers import split_layers

# HF module names -> the megatron linear that holds them (q/k/v fused, gate/up fused).
HF_TO_MEGATRON = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ROW_PARALLEL = ("linear_proj", "linear_fc2")  # input split over TP; the others split their output


@dataclass(frozen=True)
class Param:
    name: str  # stage-local name, e.g. layers.3.linear_fc1 (global layer index)
    numel: int  # elements on this rank
    trainable: bool
    kind: str  # embedding | norm | linear | output | lora


def padded_vocab(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """megatron pads the vocab to a multiple of 128*tp (same rule as ftcore.models.llama)."""
    m = multiple * tp
    return -(-vocab_size // m) * m


def lora_targets(cfg: DictConfig) -> list[str]:
    """Megatron linears that carry an adapter (HF names mapped, duplicates dropped, order kept)."""
    if cfg.peft.name not in ("lora", "qlora"):
        return []
    out: list[str] = []
    for t in cfg.peft.target_modules:
        m = HF_TO_MEGATRON.get(str(t), str(t))
        if m not in out:
            out.append(m)
    return out


def linear_shapes(m: DictConfig, tp: int) -> dict[str, tuple[int, int]]:
    """(out, in) of each layer linear on one TP rank."""
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    q, kv, h, f = (
        m.num_attention_heads * d,
        m.num_query_groups * d,
        m.hidden_size,
        m.ffn_hidden_size,
    )
    return {
        "linear_qkv": ((q + 2 * kv) // tp, h),
        "linear_proj": (h, q // tp),
        "linear_fc1": (2 * f // tp, h),
        "linear_fc2": (h, f // tp),
    }


def lora_numel(module: str, out_in: tuple[int, int], r: int, tp: int) -> tuple[int, int]:
    """(A, B) elements on one TP rank. Column-parallel base: A (r x in) replicated, B sharded like
    the base output. Row-parallel base: A sharded like the base input, B (out x r) replicated."""
    out, inp = out_in
    return r * inp, out * r


def layer_params(cfg: DictConfig, layer: int, tp: int) -> list[Param]:
    m = cfg.model
    h = m.hidden_size
    full = cfg.peft.name == "none"
    targets = lora_targets(cfg)
    shapes = linear_shapes(m, tp)
    pre = f"layers.{layer}."
    out = [Param(pre + "input_layernorm", h, full, "norm")]
    for name in LINEARS:
        if name == "linear_fc1":
            out.append(Param(pre + "pre_mlp_layernorm", h, full, "norm"))
        o, i = shapes[name]
        out.append(Param(pre + name, o * i, full, "linear"))
        if name in targets:
            a, b = lora_numel(name, (o, i), cfg.peft.r, tp)
            out.append(Param(pre + name + ".lora_A", a, True, "lora"))
            out.append(Param(pre + name + ".lora_B", b, True, "lora"))
    return out


def chunk_params(cfg: DictConfig, pp_rank: int, vp_stage: int) -> list[Param]:
    """Parameters of one model chunk (one GPTModel) of one rank, in registration order."""
    m, p = cfg.model, cfg.parallel
    tp, pp, vp = p.tp, p.pp, p.vp
    split = split_layers(m.num_layers, pp, vp)
    full = cfg.peft.name == "none"
    v = padded_vocab(m.vocab_size, tp) // tp * m.hidden_size
    first = pp_rank == 0 and vp_stage == 0
    last = pp_rank == pp - 1 and vp_stage == vp - 1
    out: list[Param] = []
    if first:
        out.append(Param("embedding", v, full, "embedding"))
    start = split.offsets[pp_rank][vp_stage]
    for layer in range(start, start + split[pp_rank][vp_stage]):
        out += layer_params(cfg, layer, tp)
    if last:
        out.append(Param("final_layernorm", m.hidden_size, full, "norm"))
        if not m.tie_embeddings or pp > 1:
            out.append(Param("output_layer", v, full, "output"))
    return out


def rank_params(cfg: DictConfig, pp_rank: int) -> list[list[Param]]:
    """Per model chunk (virtual stage) of this pipeline rank."""
    return [chunk_params(cfg, pp_rank, v) for v in range(cfg.parallel.vp)]


def total_params(cfg: DictConfig) -> int:
    """All parameters of the unsharded model (base + adapters), counted once."""
    m = cfg.model
    base = linear_shapes(m, 1)
    per_layer = 2 * m.hidden_size + sum(o * i for o, i in base.values())
    per_layer += sum(sum(lora_numel(t, base[t], cfg.peft.r, 1)) for t in lora_targets(cfg))
    emb = m.vocab_size * m.hidden_size
    return m.num_layers * per_layer + emb * (1 if m.tie_embeddings else 2) + m.hidden_size
