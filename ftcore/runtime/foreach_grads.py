"""megatron's gradient norm and clipping without Apex or Transformer Engine, as foreach kernels.

Without either, megatron falls back to `local_multi_tensor_l2_norm`, which takes one norm per
gradient and reads each back to the host (`torch.tensor` of a list of device scalars): on a GPU a
host sync per trained tensor, every step (an H200 without TE: 58 per step for a 4-layer LoRA model,
`tests/gpu/test_host_sync.py`), and on CPU one torch call per tensor. Its clipping
(`local_multi_tensor_scale`) loops in Python too. torch's foreach kernels take the whole list and
leave the norm on the device, where megatron all-reduces it and reads it once.
"""

from __future__ import annotations

import torch


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """local_multi_tensor_l2_norm's result ([1], the L2 norm over every tensor of the lists) in
    two torch calls, on the tensors' device, with no host read."""
    tensors = [t for ts in tensor_lists for t in ts]
    if not tensors:  # megatron checks before it calls; its own answer, on its device
        return torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu"), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def scale(chunk_size, noop_flag, tensor_lists, factor):
    """local_multi_tensor_scale (dst = src * factor) in one or two torch calls."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, factor)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def install() -> None:
    """Replace megatron's local fallbacks where it chose them (no TE, no Apex); TE's or Apex's
    fused kernels, where installed, stay. Idempotent."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm
    if clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = scale
