"""Tensors of the source checkpoint that ftcore neither builds nor trains but writes back unchanged:
the multi-token-prediction (MTP) layers DeepSeek-V3 and GLM-4.5 publish after their last layer
(`model.layers.<n >= num_hidden_layers>.*`, num_nextn_predict_layers of them; docs/deepseek.md).

transformers ignores them (DeepseekV3ForCausalLM lists them as unexpected keys), serving engines
use them for speculative decoding. Export copies each from `model.hf_path` byte for byte, in its
own dtype, so a fine-tuned model is served like the published one; they are the published MTP
weights, not fitted to the fine-tuned model. One exception keeps the directory in one format: an
FP8 source exported to bf16 (the default) gets its MTP weights dequantized too (hf/fp8.py), and an
FP8 export of an FP8 source copies them, scales included, as stored.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ftcore.hf import fp8, io, mappings

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def source(model_cfg) -> io.SafetensorsDir | None:
    """The source checkpoint (model.hf_path), or None without one."""
    path = model_cfg.get("hf_path")
    if not path or not Path(path).is_dir():
        return None
    return io.SafetensorsDir(path, fp8_block=model_cfg.get("fp8_block"))


def _dequantized(st: io.SafetensorsDir, block) -> bool:
    """Whether the copies are dequantized: an FP8 source, an export in another format."""
    return st.fp8_block is not None and block is None


def carried_names(st: io.SafetensorsDir | None, num_layers: int, block=None) -> list[str]:
    """The source's tensors of layers past the model's last (its MTP layers), sorted; their FP8
    scales only where they are copied as stored (`block`: an FP8 export)."""
    if st is None:
        return []
    out = []
    for name in st.files:
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= num_layers:
            if not (name.endswith(fp8.SCALE) and _dequantized(st, block)):
                out.append(name)
    return sorted(out)


def entries(st: io.SafetensorsDir | None, names: list[str], dtype: torch.dtype, block=None):
    """(name, dtype, shape) of each carried tensor: as the source stores it, or the export's
    dtype for an FP8 weight dequantized (headers only)."""
    out = []
    for name in names:
        path, meta = st.entry(name)
        if meta["dtype"] not in io.DTYPES:
            from ftcore.errors import FtcoreError

            raise FtcoreError(f"{path}: {name} is stored as {meta['dtype']}, which ftcore does not "
                              "copy", field="model.hf_path",
                              fix="a checkpoint in F32/BF16/F16/F8_E4M3 (as published)")  # fmt: skip
        own = io.DTYPES[meta["dtype"]]
        if _dequantized(st, block) and name + fp8.SCALE in st.files:
            own = dtype
        out.append((name, own, tuple(meta["shape"])))
    return out


def read(st: io.SafetensorsDir, name: str, block=None) -> torch.Tensor:
    """One carried tensor, whole: as stored, or dequantized (`_dequantized`)."""
    piece = mappings.Piece(name)
    return st.read(piece) if _dequantized(st, block) else st.raw(piece)
