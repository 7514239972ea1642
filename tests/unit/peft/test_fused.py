"""The fused LoRA linear (peft/fused.py) against the adapter path it replaces: the base GEMM plus
each slice's B(A x) * scale put into the fused layout by fuse_column (itself checked against the
Hugging Face mapping in test_layers.py). Float64, every value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ftcore.peft import fused
from ftcore.peft.config import Geometry
from ftcore.peft.layers import LoraParallelLinear, fuse_column

GEO = Geometry(hidden=8, ffn=12, heads=4, groups=2, head_dim=2)
ROW_IN = {"linear_proj": GEO.heads * GEO.head_dim, "linear_fc2": GEO.ffn}
HF = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj"}

CASES = [
    ("linear_qkv", HF),  # interleaved per query group: one dense B
    ("linear_qkv", {"k_proj": "k_proj"}),
    ("linear_qkv", dict.fromkeys(HF, "linear_qkv")),  # one A shared by the slices
    ("linear_fc1", {"gate_proj": "gate_proj", "up_proj": "up_proj"}),  # contiguous runs
    ("linear_fc1", {"up_proj": "up_proj"}),
    ("linear_fc1", {"gate_proj": "linear_fc1", "up_proj": "linear_fc1"}),
    ("linear_proj", {"o_proj": "o_proj"}),
    ("linear_fc2", {"down_proj": "down_proj"}),
]


def _module(name: str, slices: dict) -> LoraParallelLinear:
    column = name in ("linear_qkv", "linear_fc1")
    out = {"linear_qkv": (GEO.heads + 2 * GEO.groups) * GEO.head_dim,
           "linear_fc1": 2 * GEO.ffn}.get(name, GEO.hidden)  # fmt: skip
    base = nn.Linear(GEO.hidden if column else ROW_IN[name], out, bias=False, dtype=torch.float64)
    base.weight.requires_grad_(False)
    mod = LoraParallelLinear(base, name, slices, geo=GEO, r=3, scale=1.5, dropout=0.0, tp=1,
                             sp=False, dtype=torch.float64)  # fmt: skip
    for p in mod.parameters():
        if p.requires_grad:
            p.data.normal_()
    return mod


def _reference(mod: LoraParallelLinear, x: torch.Tensor) -> torch.Tensor:
    base = F.linear(x, mod.base_layer.weight)
    deltas = {
        s: F.linear(F.linear(x, mod.lora_A[mod.a_of[s]]) * mod.scale, b)
        for s, b in mod.lora_B.items()
    }
    if mod.column:
        return base + fuse_column(mod.module, deltas, mod.geo, 1)
    return base + next(iter(deltas.values()))


@pytest.mark.parametrize("name, slices", CASES, ids=lambda c: c if isinstance(c, str) else "+".join(c))  # fmt: skip
@pytest.mark.parametrize("x_grad", [True, False])
def test_fused_lora_linear_equals_base_plus_fused_deltas(name, slices, x_grad):
    mod = _module(name, slices)
    x = torch.randn(5, 2, mod.base_layer.in_features, dtype=torch.float64, requires_grad=x_grad)
    params = [p for p in mod.parameters() if p.requires_grad]
    inputs = [x, *params] if x_grad else params
    grad = torch.randn(5, 2, mod.base_layer.out_features, dtype=torch.float64)

    want = _reference(mod, x)
    want_grads = torch.autograd.grad(want, inputs, grad)
    got = fused.lora_linear(x, mod.base_layer.weight, mod._layout(), mod.scale,
                            mod.lora_A.values(), mod.lora_B.values())  # fmt: skip
    got_grads = torch.autograd.grad(got, inputs, grad)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert mod._layout().dense == (name == "linear_qkv")


def test_fused_lora_linear_gradcheck():
    mod = _module("linear_qkv", {"q_proj": "q_proj", "v_proj": "v_proj"})
    x = torch.randn(3, 1, GEO.hidden, dtype=torch.float64, requires_grad=True)
    a, b = list(mod.lora_A.values()), list(mod.lora_B.values())

    def f(x, *params):
        return fused.lora_linear(x, mod.base_layer.weight, mod._layout(), mod.scale,
                                 params[: len(a)], params[len(a) :])  # fmt: skip

    assert torch.autograd.gradcheck(f, (x, *a, *b))


@pytest.mark.parametrize("name, slices", CASES, ids=lambda c: c if isinstance(c, str) else "+".join(c))  # fmt: skip
@pytest.mark.parametrize("x_grad", [True, False])
def test_adapter_gradients_straight_into_main_grad(name, slices, x_grad):
    """Marked as wrap_ddp marks them (DDP overlap off), the adapters' gradients are added into
    their main_grad, accumulating over two micro-batches as DDP's hook would, and autograd leaves
    them no .grad. Where x carries no graph (the first layer's input with a frozen embedding) the
    adapters must stay autograd inputs, or no backward would run: DDP's hook path then."""
    mod = _module(name, slices)
    params = [p for p in mod.parameters() if p.requires_grad]
    xs = [torch.randn(5, 2, mod.base_layer.in_features, dtype=torch.float64, requires_grad=x_grad)
          for _ in range(2)]  # fmt: skip
    grads = [torch.randn(5, 2, mod.base_layer.out_features, dtype=torch.float64) for _ in xs]
    want = [torch.zeros_like(p) for p in params]
    for x, grad in zip(xs, grads):
        for w, g in zip(want, torch.autograd.grad(_reference(mod, x), params, grad)):
            w += g
    for p in params:
        p.main_grad, p.ftcore_grad_into_main = torch.zeros_like(p), True
    for x, grad in zip(xs, grads):
        out = fused.lora_linear(x, mod.base_layer.weight, mod._layout(), mod.scale,
                                mod.lora_A.values(), mod.lora_B.values())  # fmt: skip
        out.backward(grad)
    for p, w in zip(params, want):
        if x_grad:
            assert p.grad is None
            torch.testing.assert_close(p.main_grad, w, rtol=1e-12, atol=1e-12)
        else:
            assert not p.main_grad.any()
            torch.testing.assert_close(p.grad, w, rtol=1e-12, atol=1e-12)
