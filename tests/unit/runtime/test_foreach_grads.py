"""runtime/foreach_grads.py: megatron's gradient norm and clipping without TE/Apex as foreach
kernels. Same results as megatron's own fallbacks (the oracle), and, unlike them, no read of a
device value: on a GPU each such read is a host sync, one per gradient per step (found on an H200
by tests/gpu/test_host_sync.py)."""

from __future__ import annotations

import pytest
import torch
from megatron.core import utils
from megatron.core.optimizer import clip_grads
from torch.utils._python_dispatch import TorchDispatchMode

from ftcore.runtime import cpu, foreach_grads


class CountScalarReads(TorchDispatchMode):
    """Counts `_local_scalar_dense`: what .item(), float(t) and torch.tensor([t, ...]) run."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func.__name__.startswith("_local_scalar_dense")
        return func(*args, **(kwargs or {}))


def _grads() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(n, 3) for n in (1, 7, 64)]


def test_norm_is_megatrons_without_a_device_read():
    grads = _grads()
    with cpu.CudaOnCpuMode(), CountScalarReads() as theirs:  # its result goes to device="cuda"
        want, _ = utils.local_multi_tensor_l2_norm(0, None, [grads], False)
    with CountScalarReads() as ours:
        got, _ = foreach_grads.l2_norm(0, None, [grads], False)
    # the proxy sees megatron's read of the total; its per-gradient reads (torch.tensor of a list of
    # scalars) happen below the dispatcher on CPU, and were counted on the H200 instead
    assert theirs.reads >= 1
    assert ours.reads == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert foreach_grads.l2_norm(0, None, [[]], False)[0].tolist() == [0.0]


@pytest.mark.parametrize("in_place", [True, False])
def test_scale_is_megatrons(in_place):
    grads = _grads()
    src = [g.clone() for g in grads]
    dst = src if in_place else [torch.empty_like(g) for g in grads]
    ref = [g.clone() for g in grads]
    utils.local_multi_tensor_scale(0, None, [ref, ref], 0.25)
    foreach_grads.scale(0, None, [src, dst], 0.25)
    for a, b in zip(dst, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_install_replaces_only_megatrons_local_fallbacks(monkeypatch):
    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    foreach_grads.install()
    assert clip_grads.l2_norm_impl is foreach_grads.l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_grads.scale

    def fused(*args):  # stands for TE's or Apex's kernel: kept
        raise AssertionError

    monkeypatch.setattr(clip_grads, "l2_norm_impl", fused)
    foreach_grads.install()
    assert clip_grads.l2_norm_impl is fused
