"""QLoRA's frozen base: megatron's column/row-parallel linears with their weight stored as NF4
(bitsandbytes, optionally with double quantisation of the block constants).

Each TP rank quantises its own shard after the base weights are loaded. The forward dequantises the
shard to the compute dtype (fp32/bf16) and does what megatron's linear does around the GEMM:
column-parallel input copied into the TP region (all-gathered along the sequence with SP),
row-parallel output all-reduced (reduce-scattered along the sequence with SP). The weight gets no
gradient; the input does, so adapters upstream still train.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from torch import nn

from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")
BLOCKSIZE = 64


def _bnb():
    try:
        import bitsandbytes.functional as bnbf
    except ImportError as e:
        raise FtcoreError("peft=qlora needs bitsandbytes", field="peft.name",
                          fix="pip install bitsandbytes (it is in ftcore's test extra), or use peft=lora") from e  # fmt: skip
    return bnbf


class NF4ParallelLinear(nn.Module):
    """A frozen NF4 copy of a megatron ColumnParallelLinear/RowParallelLinear (no bias)."""

    def __init__(self, base: nn.Module, *, column: bool, double_quant: bool, sp: bool):
        super().__init__()
        w = base.weight.detach()
        if getattr(base, "bias", None) is not None and base.bias.numel():
            raise FtcoreError("QLoRA supports linears without bias only", field="peft.name")
        self.column, self.sp = column, sp
        self.dtype, self.shape = w.dtype, tuple(w.shape)
        packed, self.quant_state = _bnb().quantize_4bit(
            w.contiguous(), blocksize=BLOCKSIZE, compress_statistics=double_quant, quant_type="nf4"
        )
        self.qweight = nn.Parameter(packed, requires_grad=False)
        self.qweight.logical_numel = w.numel()  # what the model has, for the trainable count
        self.qweight.tensor_model_parallel = bool(
            getattr(base.weight, "tensor_model_parallel", False)
        )
        self.qweight.partition_dim = getattr(base.weight, "partition_dim", -1)

    def weight_fp(self) -> torch.Tensor:
        return (
            _bnb()
            .dequantize_4bit(self.qweight.data, self.quant_state)
            .to(self.dtype)
            .view(self.shape)
        )

    def forward(self, x: torch.Tensor, *args, **kwargs):
        w = self.weight_fp()
        if self.column:
            if self.sp:
                x = tensor_parallel.gather_from_sequence_parallel_region(
                    x, tensor_parallel_output_grad=True
                )
            else:
                x = tensor_parallel.copy_to_tensor_model_parallel_region(x)
            return F.linear(x, w.to(x.dtype)), None
        out = F.linear(x, w.to(x.dtype))
        if self.sp:
            return tensor_parallel.reduce_scatter_to_sequence_parallel_region(out), None
        return tensor_parallel.reduce_from_tensor_model_parallel_region(out), None

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata=None
    ) -> dict:
        return {}  # the frozen base comes back from model.hf_path / init_path, never from a checkpoint


def quantize_linear(base: nn.Module, *, double_quant: bool, sp: bool) -> nn.Module:
    """The NF4 replacement of one megatron linear (column: linear_qkv/linear_fc1)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(base, ColumnParallelLinear):
        return NF4ParallelLinear(base, column=True, double_quant=double_quant, sp=sp)
    if isinstance(base, RowParallelLinear):
        return NF4ParallelLinear(base, column=False, double_quant=double_quant, sp=sp)
    raise FtcoreError(f"QLoRA needs megatron's local linears, got {type(base).__name__}", field="peft.name",
                      fix="QLoRA builds with the local layer spec (precision.te_layers is ignored)")  # fmt: skip
