"""RMSNorm for megatron's local layer spec that also works with sequence parallelism.

megatron's WrappedTorchNorm refuses sequence_parallel. Under SP each TP rank normalises its own
sequence slice, so the weight's gradient is partial: marking it `sequence_parallel` makes megatron's
finalize_model_grads all-reduce it across the TP group.

The norm is one autograd function: autograd over its six elementwise ops records as many nodes and
runs about ten kernels backward (plus an add where x's two gradients meet); the closed-form
backward below runs five, and the weight's reduction only when the weight trains (not under LoRA).
Both avoid [tokens, h] temporaries where one op can do (the norm's reduction, addcmul_): on a CPU
each is a fresh buffer through the caches (A/B in one process: 0.99 of the packed LoRA step).
"""

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 activations; float64 stays float64 (tests, gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x32 = x.to(_compute_dtype(x))
        # mean(x^2) from the norm's reduction: no [tokens, h] temporary for x^2
        norm = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)  # [..., 1]
        r = norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        w = weight.to(x32.dtype)
        ctx.save_for_backward(x, weight, r)
        return (x32 * r).mul_(w).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, r = ctx.saved_tensors
        ct = _compute_dtype(x)
        x32, g = x.to(ct), grad.to(ct)
        gw = g * weight.to(ct)
        # y = x r w with r = (mean(x^2) + eps)^-1/2: dx = r gw - x r^3 mean(gw x)
        m = (gw * x32).mean(-1, keepdim=True).mul_(r.pow(3))
        dx = gw.mul_(r).addcmul_(x32, m, value=-1) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (g * x32 * r).reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        return (dx.to(x.dtype) if dx is not None else None), dw, None


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        # created where megatron creates its own weights (use_cpu_initialization: the default
        # device, e.g. the CPU runtime's or a dry build's meta; else this rank's GPU)
        device = (
            None if getattr(config, "use_cpu_initialization", True) else torch.cuda.current_device()
        )
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=device)
        )
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)
