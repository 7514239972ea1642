"""The CPU runtime's attention for packed documents against torch's SDPA, the oracle: the batched
causal kernel (GQA without copies, mask and scale in one baddbmm) and the per-head gathers that
put every document's output back in megatron's order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftcore.models.local.attention import causal_attention, documents


@pytest.mark.parametrize("heads, groups, width", [(8, 4, 24), (4, 4, 16), (6, 1, 5), (4, 2, 128)])
def test_causal_attention_is_sdpa(heads, groups, width):
    torch.manual_seed(0)
    q = torch.randn(3, heads, width, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(3, groups, width, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    out = causal_attention(q, k, v, 0.3)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("matmul_width", [128, 0], ids=["matmuls", "flash"])
def test_per_document_attention_is_sdpa_per_document(matmul_width, monkeypatch):
    """Documents of 1-11 tokens in two rows (positions flattened [s, b] as megatron orders
    them): each output position equals SDPA over its own document's prefix; padding (segment 0)
    and one-token documents take their value. Buckets wider than MATMUL_WIDTH take the flash
    kernel."""
    from ftcore.models.local import attention

    monkeypatch.setattr(attention, "MATMUL_WIDTH", matmul_width)
    _check_per_document(
        torch.tensor([[1] * 11 + [2] * 3 + [3] + [0], [1] * 2 + [2] * 7 + [3] * 5 + [0] * 2])
    )
    _check_per_document(torch.tensor([[1, 2, 3, 0], [1, 0, 0, 0]]))  # one-token documents only


def _check_per_document(seg):
    """Values and the gradients into Q, K and V (whose backward gathers from each token's real
    slot, models/gather.py) against SDPA run document by document."""
    from ftcore.models.local.attention import SdpaAttention

    b, s = seg.shape
    heads, groups, d = 4, 2, 8
    torch.manual_seed(1)
    q = torch.randn(s, b, heads, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(s, b, groups, d, dtype=torch.float64, requires_grad=True) for _ in "kv")
    attn = SdpaAttention.__new__(SdpaAttention)  # the method reads only the softmax scale
    attn.softmax_scale = 0.5
    out = attn._per_document(q, k, v, documents(seg, min_width=4)).view(s, b, heads, d)
    ref = torch.zeros_like(out)
    for r in range(b):
        ids = seg[r].tolist()
        for start in range(s):
            if start and ids[start] == ids[start - 1] and ids[start]:
                continue  # not the first token of its document
            end = start + 1
            while ids[start] and end < s and ids[end] == ids[start]:
                end += 1
            qd, kd, vd = (t[start:end, r].transpose(0, 1)[None] for t in (q, k, v))
            doc = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=0.5,
                                                 enable_gqa=True)  # fmt: skip
            ref[start:end, r] = doc[0].transpose(0, 1)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    grads = [
        torch.autograd.grad(t, (q, k, v), grad, allow_unused=True, materialize_grads=True)
        for t in (out, ref)
    ]  # one-token documents only: the output does not read the queries
    for got, want, name in zip(*grads, "qkv"):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("cuda_path", [False, True], ids=["cpu", "cuda_path"])
@pytest.mark.parametrize("heads, groups, one_mask", [(4, 2, False), (4, 4, False), (6, 1, True)])
def test_attention_at_rows_is_sdpa_at_those_rows(heads, groups, one_mask, cuda_path, monkeypatch):
    """The last layer's queries at the target rows only (models/target_logits.py): the same
    outputs, and the same gradients into Q, K and V, as SDPA over every row with the mask, picked
    at those rows; packed documents and padding in one batch of three sequences, or one causal
    mask for every sequence. `cuda_path`: the CUDA choices taken on CPU (K/V heads expanded for
    GQA, cuDNN left out), so the GPU's head order is checked here too."""
    from ftcore.data.packing import attention_mask_from_segments
    from ftcore.models.local import attention
    from ftcore.models.local.attention import attention_at_rows

    monkeypatch.setattr(attention, "on_cuda", lambda t: cuda_path)

    seg = torch.tensor([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12, [1] * 2 + [2] * 7 + [0] * 3])
    b, s = seg.shape
    if one_mask:
        seg = torch.ones_like(seg)
    mask = attention_mask_from_segments(seg)  # [b, 1, s, s], True = masked out
    if one_mask:
        mask = mask[:1]  # [1, 1, s, s], broadcast over the sequences
    rows = torch.tensor([0, 4, 7, 13, 20, 25, 34])  # flattened [s, b]: position * b + sequence
    torch.manual_seed(2)
    q = torch.randn(s, b, heads, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(s, b, groups, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    ref = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=~mask, scale=0.4, enable_gqa=True
    )  # [b, heads, s, d]
    ref = ref.permute(2, 0, 1, 3).reshape(s * b, heads * 8).index_select(0, rows)
    out = attention_at_rows(q, k, v, mask, rows, 0.4)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    for a, r in zip(
        torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
    ):
        torch.testing.assert_close(a, r)
    half = attention_at_rows(*(t.detach().bfloat16() for t in (q, k, v)), mask, rows, 0.4)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), ref.detach(), rtol=2e-2, atol=2e-2)


def test_varying_shape_backends_leave_cudnn_out_and_keep_a_fallback():
    """The document-bucket and target-row SDPA calls change shape every micro-batch: on CUDA they
    run without cuDNN (a plan build per new shape, docs/gpu/2026-11-26-nvidia-h200.md), and the
    backends left can run both call forms (math takes anything); on CPU nothing is restricted."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ftcore.models.local import attention

    assert SDPBackend.CUDNN_ATTENTION not in attention.VARYING_SHAPES
    assert isinstance(attention.varying_shapes(torch.zeros(1)), contextlib.nullcontext)
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    mask = torch.rand(2, 1, 8, 8) > 0.3
    mask[..., 0] = True
    with sdpa_kernel(attention.VARYING_SHAPES):
        causal = torch.nn.functional.scaled_dot_product_attention(
            q, k, k, is_causal=True, enable_gqa=True
        )
        masked = torch.nn.functional.scaled_dot_product_attention(
            q, k, k, attn_mask=mask, enable_gqa=True
        )
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    assert torch.allclose(causal, ref) and masked.isfinite().all()
