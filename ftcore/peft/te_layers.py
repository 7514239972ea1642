"""LoRA on Transformer Engine's megatron linears (the GPU layer spec), reusing the parallel-state
logic of `ftcore.peft.layers.LoraParallelLinear` unchanged.

What differs from megatron's local linears:
- TELayerNormColumnParallelLinear (linear_qkv, linear_fc1) fuses the pre-norm into its GEMM, so
  its input is the un-normalised residual stream while the adapter must see the normalised one.
  The base is asked to also return its norm output (TE's `return_layernorm_output`): TE then keeps
  that output in high precision even under FP8, and back-propagates the adapter's gradient through
  the norm. Not gathered: with sequence parallelism it is this rank's sequence chunk, which is
  what `column_lora` expects (it gathers the small rank-r product instead).
- TEColumnParallelLinear / TERowParallelLinear take and return the same shards as megatron's
  column / row linears, so the shared logic applies as is.
- Under an FP8/FP4 recipe only the base GEMMs are quantised: the adapter runs outside the
  autocast (`precision.adapter_autocast_off`), in the adapter dtype, on a dequantised input.
"""

from __future__ import annotations

from torch import nn

from ftcore.peft.layers import LoraParallelLinear
from ftcore.precision.recipes import adapter_autocast_off, high_precision

# TELinear: MLA's down projections ("duplicated", whole on every TP rank; models/mla.py)
TE_LINEARS = ("TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear",
              "TELinear")  # fmt: skip


def is_te_linear(module: nn.Module) -> bool:
    """A megatron TE linear, recognised by class name so this never imports TE (CPU-safe)."""
    return any(c.__name__ in TE_LINEARS for c in type(module).__mro__)


def fuses_norm(module: nn.Module) -> bool:
    """TE's LayerNormLinear (and megatron's wrapper of it) can hand back its norm output."""
    return hasattr(module, "return_layernorm_output")


class TELoraParallelLinear(LoraParallelLinear):
    """LoraParallelLinear over a TE base: the adapter reads the fused norm's output and runs in
    high precision outside any FP8/FP4 autocast."""

    def __init__(self, base: nn.Module, module: str, slices: dict[str, str], **kwargs):
        super().__init__(base, module, slices, **kwargs)
        self.fused_norm = fuses_norm(base)
        if self.fused_norm:
            base.return_layernorm_output = True
            base.return_layernorm_output_gathered = False

    def forward(self, x, *args, **kwargs):
        out, bias = self.base_layer(x, *args, **kwargs)
        adapter_in = x
        if self.fused_norm:
            out, adapter_in = out  # (GEMM output, norm output)
        if not self.adapters_on:  # DPO's reference (peft/reference.py)
            return out, bias
        with adapter_autocast_off():
            delta = self.lora_delta(high_precision(adapter_in))
        return out + delta.to(out.dtype), bias


def lora_linear(
    base: nn.Module, module: str, slices: dict[str, str], **kwargs
) -> LoraParallelLinear:
    """The LoRA wrapper for `base`: the TE variant over TE linears, the local one otherwise."""
    cls = TELoraParallelLinear if is_te_linear(base) else LoraParallelLinear
    return cls(base, module, slices, **kwargs)
