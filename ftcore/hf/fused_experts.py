"""Read transformers 5's fused expert layout too (docs/moe.md).

In memory transformers 5 holds a MoE layer's experts as two 3D parameters, and
`save_pretrained(save_original_format=False)` (or a save it cannot convert back, e.g. offloaded)
writes them so: `model.layers.N.mlp.experts.gate_up_proj` [E, 2*I, H] (each expert's gate rows,
then its up rows), `...mlp.experts.down_proj` [E, H, I] and the router `...mlp.gate.weight`, for
Qwen3-MoE and Mixtral alike. The mapping (hf/mappings.py) speaks the published per-expert names;
a directory in the fused layout has each per-expert piece turned into the same rows or columns of
its expert's slice of the fused tensor, so a rank still reads only its own experts. Export always
writes the published layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ftcore.hf.mappings import Piece, Shapes

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")  # fmt: skip
_ROUTER = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
         "w2": "down"}  # fmt: skip


def is_fused(names: Iterable[str]) -> bool:
    return any(n.endswith(".mlp.experts.gate_up_proj") for n in names)


def fused_name(hf: str) -> tuple[str, int | None, str | None]:
    """(fused tensor name, expert index, part) of a published name; (hf, None, None) otherwise."""
    m = _EXPERT.match(hf)
    if m:
        part = _PART[m.group(3)]
        tensor = "down_proj" if part == "down" else "gate_up_proj"
        return f"{m.group(1)}.mlp.experts.{tensor}", int(m.group(2)), part
    r = _ROUTER.match(hf)
    return (f"{r.group(1)}.mlp.gate.weight", None, None) if r else (hf, None, None)


def fused_piece(piece: Piece, moe_ffn: int) -> Piece:
    """The same rows/columns of the fused tensor (a piece of a non-expert tensor unchanged)."""
    if piece.hf is None:
        return piece
    name, expert, part = fused_name(piece.hf)
    if part in ("gate", "up"):
        a, b = piece.rows or (0, moe_ffn)
        off = moe_ffn if part == "up" else 0
        return Piece(name, rows=(a + off, b + off), cols=piece.cols, expert=expert)
    return Piece(name, rows=piece.rows, cols=piece.cols, expert=expert)


def fused_shapes(names: Iterable[str], s: Shapes, shape_of) -> dict[str, tuple[int, ...]]:
    """{tensor name: full shape} of the fused layout for the published `names` (`shape_of`:
    mappings.hf_shape)."""
    out: dict[str, tuple[int, ...]] = {}
    for n in names:
        name, expert, part = fused_name(n)
        if part is None:
            out[name] = tuple(shape_of(n, s))
        elif part == "down":
            out[name] = (s.experts, s.hidden, s.moe_ffn)
        else:
            out[name] = (s.experts, 2 * s.moe_ffn, s.hidden)
    return out
