"""FP8 block-scaled checkpoints as DeepSeek publishes V3/R1 (and Kimi-K2): docs/deepseek.md.

Each linear weight W [out, in] is stored as float8_e4m3fn Q with a float32 `<name>_scale_inv`
S [ceil(out / b0), ceil(in / b1)], one per b0 x b1 block (`quantization_config.weight_block_size`,
[128, 128] as published): W[i, j] = Q[i, j] * S[i // b0, j // b1]. Embeddings, the LM head, norms,
the router and the expert bias stay in bf16/fp32.

Reading dequantizes each rank's slice only: the rows/columns of Q the mapping asks for and the
block rows/columns of S that cover them (hf/io.py SafetensorsDir.read), in fp32 (an fp8 value
times its fp32 scale, as transformers' own dequantization computes it), then the parameter's dtype.
Export writes bf16 unless `export.dtype=fp8`: then every weight that the published checkpoints
hold in FP8 is quantized per block (scale = the block's largest |w| / 448, e4m3's largest value)
with the source's block size ([128, 128] without one).
"""

from __future__ import annotations

import math
import re

import torch

from ftcore.errors import FtcoreError

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
# the linear weights published in FP8 (DeepSeek-V3): attention, dense MLP, routed and shared
# experts; not the router (`mlp.gate.weight`), embeddings, head or norms
_QUANTIZED = re.compile(
    r"\.(?:self_attn\.(?:q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|k_proj|"
    r"v_proj)|mlp\.(?:shared_experts\.|experts\.\d+\.)?(?:gate_proj|up_proj|down_proj))\.weight$"
)


def block_of(hf: dict, f: str = "config.json") -> list[int] | None:
    """The FP8 block of a config.json's `quantization_config` (None: not quantized); any other
    quantization is refused naming its key."""
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    bad = []
    if method != "fp8":
        bad.append(f"quantization_config.quant_method={method}")
    if q.get("fmt", "e4m3") != "e4m3":
        bad.append(f"quantization_config.fmt={q['fmt']}")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(int(b) > 0 for b in block)):
        bad.append(f"quantization_config.weight_block_size={block} (per-tensor FP8)")
    if q.get("scale_fmt") not in (None, "float32"):
        bad.append(f"quantization_config.scale_fmt={q['scale_fmt']}")
    if bad:
        raise FtcoreError(f"{f}: {', '.join(bad)} is not read", field="model.hf_path",
                          fix="a bf16/fp32 checkpoint, or FP8 with block scales (e4m3, "
                              "weight_block_size, float32 weight_scale_inv) as DeepSeek publishes")  # fmt: skip
    return [int(b) for b in block]


def quantized(name: str) -> bool:
    """Whether the published FP8 format holds this HF tensor in FP8."""
    return bool(_QUANTIZED.search(name))


def grid(shape: tuple[int, int], block) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize(q: torch.Tensor, scale: torch.Tensor, block, r0: int, c0: int) -> torch.Tensor:
    """fp32 W of Q's slice that starts at row r0, column c0 of the full tensor; `scale` holds the
    block rows r0 // b0 ... and columns c0 // b1 ... that cover it."""
    b0, b1 = block
    rows = (torch.arange(q.shape[0]) + r0) // b0 - r0 // b0
    cols = (torch.arange(q.shape[1]) + c0) // b1 - c0 // b1
    s = scale.float()[rows.to(scale.device)][:, cols.to(scale.device)]
    return q.float() * s


def scale_span(rows: tuple[int, int], cols: tuple[int, int], block) -> tuple[tuple, tuple]:
    """The block rows and columns of S that cover Q[rows, cols]."""
    (r0, r1), (c0, c1), (b0, b1) = rows, cols, block
    return (r0 // b0, (r1 - 1) // b0 + 1), (c0 // b1, (c1 - 1) // b1 + 1)


def quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q float8_e4m3fn, S float32) of a 2-D weight: each block scaled so its largest |w| is 448
    (an all-zero block: scale 1)."""
    b0, b1 = block
    rows, cols = w.shape
    g0, g1 = grid((rows, cols), block)
    wf = torch.nn.functional.pad(w.float(), (0, g1 * b1 - cols, 0, g0 * b0 - rows))
    blocks = wf.view(g0, b0, g1, b1)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(g0 * b0, g1 * b1)[:rows, :cols].contiguous(), scale.contiguous()


def export_entries(name: str, shape: tuple, dtype: torch.dtype, block) -> list[tuple]:
    """(name, dtype, shape) of what export writes for one HF tensor: itself, or with `block` and
    a weight published in FP8, the FP8 weight and its scales."""
    if block is None or len(shape) != 2 or not quantized(name):
        return [(name, dtype, tuple(shape))]
    return [(name, torch.float8_e4m3fn, tuple(shape)),
            (name + SCALE, torch.float32, grid(tuple(shape), block))]  # fmt: skip


def config_keys(block) -> dict:
    """config.json's `quantization_config` of an FP8 export (DeepSeek-V3's spelling)."""
    return {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                    "quant_method": "fp8", "weight_block_size": list(block)}}  # fmt: skip
