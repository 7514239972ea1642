"""THD (packed) parameters for Transformer Engine's attention, with nothing left for TE to read
back from the device.

TE 2.9's `DotProductAttention.forward` takes `pad_between_seqs`; left None it decides it itself,
per attention layer and micro-batch, with `torch.equal` on the device's `cu_seqlens` and
`cu_seqlens_padded` (a host sync in every layer under CP, where the padded boundaries are given).
ftcore knows the answer on the host when it builds the micro-batch, so it passes it: megatron's
`PackedSeqParams` has no such field and its `TEDotProductAttention` forwards only the fields it
knows, hence the subclasses here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class ThdParams(PackedSeqParams):
    pad_between_seqs: bool = False


def pad_between_seqs(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None) -> bool:
    """TE's own rule (dot_product_attention.py, qkv_format "thd"): padding lies between the
    documents when the padded starts differ from the real ones. Host tensors: no device read."""
    if cu_seqlens_padded is None:
        return False
    return not torch.equal(cu_seqlens_padded[:-1], cu_seqlens[:-1])


def forwarding_pad_between_seqs(base: type) -> type:
    """`base` (megatron's TEDotProductAttention) forwarding ThdParams.pad_between_seqs to TE."""

    class ThdDotProductAttention(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.kept_packed_seq_params.add("pad_between_seqs")

        def forward(self, *args, packed_seq_params=None, **kwargs):
            if packed_seq_params is not None and not isinstance(packed_seq_params, ThdParams):
                packed_seq_params = ThdParams(**vars(packed_seq_params), pad_between_seqs=None)
            return super().forward(*args, packed_seq_params=packed_seq_params, **kwargs)

    ThdDotProductAttention.__name__ = ThdDotProductAttention.__qualname__ = f"Thd{base.__name__}"
    return ThdDotProductAttention


def install(spec) -> None:
    """The TE layer spec's core attention, forwarding pad_between_seqs."""
    core = spec.submodules.self_attention.submodules
    core.core_attention = forwarding_pad_between_seqs(core.core_attention)
