"""Transformer Engine's delayed scaling (precision=fp8_delayed) where ftcore applies TE's own rules
itself, each read from TE 2.9's source (file and function named below; docs/gpu_path.md, issue 50
items 4 and 5).

Under delayed scaling a tensor is cast to FP8 with a scale its quantizer holds, computed from the
amax history of earlier steps; the quantizer starts at scale 1. Two of ftcore's paths meet that
starting scale where training never would:
- a weight stored in FP8 (`precision.fp8_param_gather`) and loaded from a checkpoint
  (`hf/io.py load_weights`): its `copy_` casts with the quantizer's scale, 1, so small weights turn
  subnormal or zero, and a frozen LoRA base is never cast again. `scale_for_load` first gives the
  quantizer the scale TE's update would compute from that weight's own amax.
- a forward under no_grad (DPO's reference, objective.precompute_ref's whole pass): TE updates the
  scales at the autocast's exit only with grad enabled, so every such forward before step 1's
  backward ran at scale 1. `update_after_no_grad_forward` does what that exit does with grad.
"""

from __future__ import annotations

import torch

E4M3_MAX, E5M2_MAX = 448.0, 57344.0  # TE's Format.E4M3 / E5M2 max_fwd (common/recipe)


def _te_float8_quantizer():
    try:
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
    except Exception:  # no TE (ImportError, or OSError from missing CUDA libraries)
        return None
    return Float8Quantizer


def is_delayed(quantizer) -> bool:
    """TE's delayed-scaling quantizer (Float8Quantizer; current scaling is
    Float8CurrentScalingQuantizer). Without TE, a stand-in named as TE's class (CPU tests)."""
    cls = _te_float8_quantizer()
    if cls is not None:
        return isinstance(quantizer, cls)
    return type(quantizer).__name__ == "Float8Quantizer"


def scale_from_amax(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int):
    """TE 2.9, pytorch/quantization.py `_default_sf_compute`: fp8_max / amax / 2^margin; the
    previous scale where amax is 0 or not finite; float32's max where the quotient overflows."""
    sf = (fp8_max / amax) / (2**margin)
    sf = torch.where(amax > 0.0, sf, scale)
    sf = torch.where(torch.isfinite(amax), sf, scale)
    return torch.where(torch.isinf(sf), torch.full_like(sf, torch.finfo(torch.float32).max), sf)


@torch.no_grad()
def scale_for_load(param, whole: torch.Tensor, margin: int) -> None:
    """Before `param.copy_(whole)` into a delayed-scaling FP8 parameter: its quantizer's scale from
    `whole`'s amax, as TE's delayed-scaling update sets it (`scale_from_amax`). TE's cast
    (pytorch/tensor/float8_tensor.py `Float8Quantizer.update_quantized` -> `tex.quantize`) uses the
    quantizer's stored scale, never the tensor's amax, and starts it at 1. A no-op for any other
    parameter."""
    get = getattr(param, "_get_quantizer", None)
    quantizer = get() if get is not None else None
    if quantizer is None or not is_delayed(quantizer):
        return
    fp8_max = E5M2_MAX if "E5M2" in str(getattr(quantizer, "dtype", "")) else E4M3_MAX
    amax = whole.detach().abs().max().float().to(quantizer.scale.device)
    quantizer.scale.copy_(scale_from_amax(amax, quantizer.scale, fp8_max, margin))


def update_after_no_grad_forward(cfg) -> None:
    """After one forward under no_grad inside TE's FP8 autocast (delayed scaling only): the amax
    reduction and scale update TE's autocast exit would have run with grad enabled (TE 2.9,
    pytorch/quantization.py `FP8GlobalStateManager.autocast_exit`: `... and
    torch.is_grad_enabled()` -> `reduce_and_update_fp8_tensors(forward=True)`). The modules
    registered their amaxes in the forward whatever the grad mode (module/base.py
    `prepare_forward`). A no-op for other recipes and without TE."""
    if cfg.precision.fp8_recipe != "delayed":
        return
    from ftcore.precision import recipes

    if recipes.te_module() is None:
        return
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE < 2.8 kept it in fp8.py
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)
