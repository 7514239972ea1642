"""What-if probes for benchmarks: measure a change before anyone makes it in ftcore proper.

Each probe is switched on by an environment variable in a bench run's `env` and patches only the
benchmark's own worker process; none of them changes the loss (same math, fewer wasted FLOPs):
- FTCORE_PROBE_SDPA=1: megatron's local DotProductAttention (baddbmm, masked fp32 softmax, bmm,
  GQA by repeat_interleave) replaced by torch's scaled_dot_product_attention with the same
  boolean mask and scale (CPU attention kernels, GQA without copies);
- FTCORE_PROBE_TRIM=1: unpacked micro-batches cut to their longest row instead of data.seq_len
  (what DataCollatorForSeq2Seq does; exact because padding is masked out of attention and loss).
  Only with pp=1: pipeline sends need a fixed shape.
- FTCORE_PROBE_CONTIG_GRAD=1: megatron's LinearWithFrozenWeight (the frozen output layer under
  LoRA) gets a contiguous output gradient. GPTModel returns logits.transpose(0, 1).contiguous(),
  so the gradient reaching the output layer is a transposed view, and grad_output.matmul(weight)
  on a non-contiguous 3-D tensor runs as a bmm over an expanded weight instead of one GEMM.
(FTCORE_CPU_MODE_IN_FORWARD=1, the CPU runtime's own switch, needs no probe.)
"""

from __future__ import annotations

import logging
import os

import torch.nn.functional as F

log = logging.getLogger("ftcore")


def _sdpa_forward(self, query, key, value, attention_mask, attn_mask_type=None,
                  attention_bias=None, packed_seq_params=None):  # fmt: skip
    """[s, b, heads, d] in, [s, b, heads * d] out, like DotProductAttention.forward."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    allowed = None if attention_mask is None else ~attention_mask  # megatron: True = masked out
    p = self.config.attention_dropout if self.training else 0.0
    ctx = F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, dropout_p=p, scale=self.softmax_scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )  # fmt: skip
    s, b = query.shape[0], query.shape[1]
    return ctx.permute(2, 0, 1, 3).reshape(s, b, -1)


def _frozen_backward_contiguous(ctx, grad_output):
    """LinearWithFrozenWeight.backward with a contiguous grad_output (one GEMM)."""
    import torch.distributed as dist

    (weight,) = ctx.saved_tensors
    grad_input = grad_output.contiguous().matmul(weight)
    if ctx.allreduce_dgrad:
        dist.all_reduce(grad_input, group=ctx.tp_group)
    return grad_input, None, None, None, None


def _trim(mb):
    """Cut an unpacked micro-batch to its longest row (rows hold their tokens from position 0)."""
    n = int((mb.segment_ids > 0).sum(dim=1).max())
    n = max(n, 2)
    if n >= mb.tokens.shape[1]:
        return mb
    for name in ("tokens", "labels", "loss_mask", "position_ids", "segment_ids"):
        setattr(mb, name, getattr(mb, name)[:, :n].contiguous())
    return mb


def apply(state) -> list[str]:
    """Switch on the probes named in the environment; returns their names."""
    on = []
    if os.environ.get("FTCORE_PROBE_SDPA") == "1":
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        DotProductAttention.forward = _sdpa_forward
        on.append("sdpa")
    if os.environ.get("FTCORE_PROBE_CONTIG_GRAD") == "1":
        from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

        LinearWithFrozenWeight.backward = staticmethod(_frozen_backward_contiguous)
        on.append("contig_grad")
    if os.environ.get("FTCORE_PROBE_TRIM") == "1":
        if state.cfg.data.packing or state.cfg.parallel.pp > 1:
            log.warning("FTCORE_PROBE_TRIM: only for unpacked data at pp=1; not applied")
        else:
            inner = state.loader.next_microbatches
            state.loader.next_microbatches = lambda: [_trim(mb) for mb in inner()]
            on.append("trim")
    if on:
        log.info("bench probes on: %s", ", ".join(on))
    return on
