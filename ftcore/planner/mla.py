"""Multi-head latent attention (DeepSeek-V3, Kimi-K2) and shared experts in the planner's model
terms: parameters, FLOPs' head widths, saved activations (docs/deepseek.md, docs/planner.md).

MLA's linears on one TP rank, as megatron builds them (models/mla.py): the down projections
q_a [q_lora, h] and kv_a [kv_lora + rope, h] whole on every rank (TE's "duplicated", ftcore's local
spec too), the up projections q_b [heads * (nope + rope), q_lora] (or one q_proj from h) and kv_b
[heads * (nope + v), kv_lora] split by heads, o_proj [h, heads * v] split by its input; the
latent norms [q_lora] and [kv_lora] replicated. Attention itself runs on heads of nope + rope for
q.k and v for the values: its FLOPs and the K/V a CP ring moves are those of a head width of
(nope + rope + v) / 2 for each of K and V (`kv_width`).
"""

from __future__ import annotations

from ftcore.config.families import family

REPLICATED = ("linear_q_down_proj", "linear_kv_down_proj")


def is_mla(m) -> bool:
    return family(m).mla


def dims(m) -> tuple[int, int, int, int, int]:
    """(q_lora (0: none), kv_lora, nope, rope, v)."""
    return (int(getattr(m, "q_lora_rank", None) or 0), int(m.kv_lora_rank), int(m.qk_nope_head_dim),
            int(m.qk_rope_head_dim), int(m.v_head_dim))  # fmt: skip


def attention_linears(m, tp: int) -> dict[str, tuple[int, int]]:
    """(out, in) of MLA's linears on one TP rank, in megatron's registration order."""
    q_lora, kv_lora, nope, rope, v = dims(m)
    n, h = m.num_attention_heads, m.hidden_size
    out = {"linear_proj": (h, n * v // tp)}
    if q_lora:
        out.update(
            linear_q_down_proj=(q_lora, h), linear_q_up_proj=(n * (nope + rope) // tp, q_lora)
        )
    else:
        out["linear_q_proj"] = (n * (nope + rope) // tp, h)
    out.update(linear_kv_down_proj=(kv_lora + rope, h),
               linear_kv_up_proj=(n * (nope + v) // tp, kv_lora))  # fmt: skip
    return out


def latent_norms(m) -> int:
    """Elements of the q and kv latent norms (replicated)."""
    q_lora, kv_lora, *_ = dims(m)
    return q_lora + kv_lora


def head_dims(m) -> tuple[int, int]:
    """(q/k head width, v head width)."""
    _, _, nope, rope, v = dims(m)
    return nope + rope, v


def slice_out_in(m, name: str) -> tuple[int, int] | None:
    """Full (out, in) of one of MLA's Hugging Face modules (None: not MLA's)."""
    full = attention_linears(m, 1)
    key = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj",
           "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
           "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}.get(name)  # fmt: skip
    return full.get(key) if key else None


def latent_saved(m, tokens: int, hs_tokens: int, ab: int, keeps) -> int:
    """Bytes one MLA layer saves beyond standard attention's accounting, one micro-batch: the
    latents before and after their norms (and the norms' fp32 rstd), the rotary key
    [tokens, rope] gathered for every head. `hs_tokens`: this rank's tokens under SP; `keeps(x)`:
    whether linear x keeps its input."""
    q_lora, kv_lora, _, rope, _ = dims(m)
    latent = hs_tokens * (2 * (q_lora + kv_lora) * ab + 8)
    return latent + tokens * rope * ab * (2 if keeps("linear_kv_up_proj") else 1)
