"""TELoraParallelLinear's own logic on CPU (TE itself is GPU-only; tests/gpu runs the real layers).

TELayerNormColumnParallelLinear fuses the pre-norm into the GEMM and, asked with
`return_layernorm_output`, also returns the norm output. `NormColumn` below reproduces exactly that
contract from megatron's own ColumnParallelLinear and ftcore's RMSNorm, so the TE wrapper over it
must equal the local LoRA layer over norm-then-linear: outputs and every gradient (the input's
through the norm included), at TP=1 and at TP=2 with and without sequence parallelism.
"""

from __future__ import annotations

import pytest


def _case(tp: int, sp: bool) -> dict:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from torch import nn

    from ftcore.models.local.norm import RMSNorm
    from ftcore.peft.config import Geometry, plan_targets
    from ftcore.peft.layers import LoraParallelLinear
    from ftcore.peft.te_layers import TELoraParallelLinear, is_te_linear, lora_linear

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    h, heads, groups, d, ffn, s, b, r = 64, 4, 2, 16, 128, 8, 2, 4
    config = TransformerConfig(
        num_layers=1, hidden_size=h, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=d, tensor_model_parallel_size=tp, sequence_parallel=sp,
        use_cpu_initialization=True, add_bias_linear=False, gradient_accumulation_fusion=False,
    )  # fmt: skip
    geo = Geometry.of(config)
    init = nn.init.normal_

    class NormColumn(nn.Module):
        """TE LayerNormLinear's contract: ((out, norm_out), bias) when return_layernorm_output."""

        def __init__(self, norm, column):
            super().__init__()
            self.norm, self.column = norm, column
            self.return_layernorm_output = False
            self.return_layernorm_output_gathered = False

        def forward(self, x):
            ln = self.norm(x)
            out, bias = self.column(ln)
            return ((out, ln) if self.return_layernorm_output else out), bias

    torch.manual_seed(1)
    column = ColumnParallelLinear(h, (heads + 2 * groups) * d, config=config, init_method=init,
                                  bias=False, gather_output=False, skip_bias_add=True)  # fmt: skip
    row = RowParallelLinear(heads * d, h, config=config, init_method=init, bias=False,
                            input_is_parallel=True, skip_bias_add=True)  # fmt: skip
    norm = RMSNorm(config, h)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    for m in (column, row, norm):
        for p in m.parameters():
            p.requires_grad_(False)

    kw = dict(geo=geo, r=r, scale=2.0, dropout=0.0, tp=tp, sp=sp, dtype=torch.float32)
    qkv = plan_targets(["linear_qkv"])["linear_qkv"]
    local = LoraParallelLinear(column, "linear_qkv", qkv, **kw)
    te = TELoraParallelLinear(NormColumn(norm, column), "linear_qkv", qkv, **kw)
    assert te.fused_norm and te.base_layer.return_layernorm_output
    local_row = LoraParallelLinear(row, "linear_proj", {"o_proj": "o_proj"}, **kw)
    te_row = TELoraParallelLinear(row, "linear_proj", {"o_proj": "o_proj"}, **kw)
    assert not te_row.fused_norm
    assert (
        not is_te_linear(column)
        and type(lora_linear(row, "linear_proj", {"o_proj": "o_proj"}, **kw)) is LoraParallelLinear
    )

    g = torch.Generator().manual_seed(2)  # same adapter weights on both, non-zero B
    for a, b_ in ((local, te), (local_row, te_row)):
        for name, p in a.named_parameters():
            if "lora_" in name:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                    dict(b_.named_parameters())[name].copy_(p)

    seq = s // tp if sp else s
    x0 = torch.randn(
        seq,
        b,
        h,
        generator=torch.Generator().manual_seed(3 + ps.get_tensor_model_parallel_rank() * sp),
    )
    xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    ya, _ = local(norm(xa))
    yb, _ = te(xb)
    ra, _ = local_row(torch.tanh(ya[..., : heads * d // tp]))
    rb, _ = te_row(torch.tanh(yb[..., : heads * d // tp]))
    (ra.square().sum() + ya.sum()).backward()
    (rb.square().sum() + yb.sum()).backward()
    out = {"y": (ya - yb).abs().max().item(), "r": (ra - rb).abs().max().item(),
           "dx": (xa.grad - xb.grad).abs().max().item(), "dx_norm": xa.grad.abs().max().item()}  # fmt: skip
    for a, b_ in ((local, te), (local_row, te_row)):
        theirs = dict(b_.named_parameters())
        for name, pa in a.named_parameters():
            if "lora_" in name:
                scale = pa.grad.abs().max().item()  # relative: these reach ~1e2-1e3 here
                out[f"{a.module}.{name}"] = (pa.grad - theirs[name].grad).abs().max().item() / scale
    return out


def _check(results):
    """Equal up to float32 rounding (relative to each gradient's size): the local layer at TP 1
    runs peft/fused.py, which sums the same products in another order."""
    for res in results:
        assert res["dx_norm"] > 0
        for key, diff in res.items():
            if key == "dx":
                assert diff < 1e-6 * res["dx_norm"], (key, diff, res)
            elif key != "dx_norm":
                assert diff < 1e-5, (key, diff, res)


def test_te_lora_equals_local_lora_tp1(pool1):
    _check(pool1.run(_case, 1, False))


@pytest.mark.parametrize("sp", [False, True])
def test_te_lora_equals_local_lora_tp2(pool2, sp):
    _check(pool2.run(_case, 2, sp))
