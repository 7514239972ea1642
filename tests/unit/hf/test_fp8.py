"""DeepSeek's FP8 block format (ftcore/hf/fp8.py) against the formula itself, on shapes the
blocks do not tile (DeepSeek-V3's kv_a_proj_with_mqa is 576 rows of 128-row blocks): a slice's
dequantization is that slice of the whole's, so a rank reading its rows reads what it needs."""

from __future__ import annotations

import pytest
import torch

from ftcore.errors import FtcoreError
from ftcore.hf import fp8


def _naive(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            out[i, j] = q[i, j].float() * s[i // block[0], j // block[1]]
    return out


def test_quantize_dequantize_on_untiled_shapes():
    torch.manual_seed(0)
    w, block = torch.randn(37, 21) * 3, (8, 16)
    q, s = fp8.quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2) and s.dtype == torch.float32
    assert q.float().abs().max() == fp8.FP8_MAX  # each block's largest value lands on 448
    full = fp8.dequantize(q, s, block, 0, 0)
    assert torch.equal(full, _naive(q, s, block))
    assert ((full - w).abs() / w.abs().amax()).max() < 0.07  # e4m3: 3 mantissa bits
    for rows, cols in (((5, 30), (3, 20)), ((16, 17), (0, 21)), ((0, 37), (17, 18))):
        (a, b), (c, d) = fp8.scale_span(rows, cols, block)
        got = fp8.dequantize(
            q[rows[0] : rows[1], cols[0] : cols[1]], s[a:b, c:d], block, rows[0], cols[0]
        )
        assert torch.equal(got, full[rows[0] : rows[1], cols[0] : cols[1]])


def test_which_tensors_are_fp8():
    for name in ("model.layers.3.self_attn.kv_b_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.5.mlp.experts.17.gate_proj.weight",
                 "model.layers.5.mlp.shared_experts.up_proj.weight"):  # fmt: skip
        assert fp8.quantized(name), name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.5.mlp.gate.weight",
                 "model.layers.5.mlp.gate.e_score_correction_bias",
                 "model.layers.3.self_attn.kv_a_layernorm.weight"):  # fmt: skip
        assert not fp8.quantized(name), name


@pytest.mark.parametrize(
    "q,key",
    [({"quant_method": "gptq", "bits": 4}, "quant_method=gptq"),
     ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size"),
     ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt=e5m2"),
     ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt")],
)  # fmt: skip
def test_other_quantization_is_refused_by_key(q, key):
    with pytest.raises(FtcoreError, match=key):
        fp8.block_of({"quantization_config": q})
    assert fp8.block_of({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                         "weight_block_size": [128, 128]}}) == [128, 128]  # fmt: skip
