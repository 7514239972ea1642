"""Host micro-batches -> the GPU without making the host wait: pinned memory, non-blocking copies.

A blocking host-to-device copy (`t.to("cuda")`) synchronises: the host waits until the GPU has run
everything queued before it, once per tensor per micro-batch, and the pipeline schedule cannot
queue the next kernels meanwhile. A non-blocking copy only enqueues the transfer, and from pinned
(page-locked) host memory the GPU's DMA engine reads it while the host goes on; the caching host
allocator keeps a pinned block alive until its copy has run. So micro-batches built for a CUDA
device are pinned on the host as they are assembled (ftcore.data.pipeline.assemble), and every
copy to a CUDA device is non-blocking (ftcore.training.step).
"""

from __future__ import annotations

import torch

from ftcore.runtime.dist import is_cuda


def pin_host_batches(device: str | torch.device) -> bool:
    """Pin micro-batches whose tensors go to `device`: a CUDA device, where CUDA is there
    (`pin_memory()` raises without it, e.g. when a GPU config is validated on a CPU machine)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def non_blocking(device: str | torch.device) -> bool:
    """Copies to a CUDA device are enqueued, not waited for (correct from pageable memory too,
    where the driver stages them; asynchronous from pinned memory). The device audit's stand-in
    for a CUDA device counts as one (runtime/device_audit.py)."""
    return is_cuda(device)


def to_device(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """`t` on `device`, without a host sync when that is a CUDA device."""
    return t.to(device, non_blocking=non_blocking(device))
