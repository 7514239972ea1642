"""RMSNorm for megatron's local layer spec that also works with sequence parallelism.

megatron's WrappedTorchNorm refuses sequence_parallel. Under SP each TP rank normalises its own
sequence slice, so the weight's gradient is partial: marking it `sequence_parallel` makes megatron's
finalize_model_grads all-reduce it across the TP group.
"""

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)
