"""The one door for ftcore's own collectives.

Every `torch.distributed` collective that ftcore issues goes through a function here, named and
shaped as torch's own, so that one place can check each tensor's device against the backend its
group has on a GPU cluster (NCCL takes CUDA tensors only; gloo, which the CPU runtime uses for
every group, takes anything). megatron-core's own collectives do not pass here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _check(tensor: torch.Tensor, group) -> None:
    """Refuse a tensor whose device the group's GPU backend would not take (filled in by the
    collectives issue: today a pass-through)."""


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    _check(tensor, group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather(tensors: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op=False):
    _check(tensor, group)
    return dist.all_gather(tensors, tensor, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    _check(tensor, group)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def barrier(group=None) -> None:
    dist.barrier(group=group)


def all_gather_object(objects: list, obj, group=None) -> None:
    dist.all_gather_object(objects, obj, group=group)


def gather_object(obj, objects: list | None = None, dst: int = 0, group=None) -> None:
    dist.gather_object(obj, objects, dst=dst, group=group)


def broadcast_object_list(objects: list, src: int = 0, group=None) -> None:
    dist.broadcast_object_list(objects, src=src, group=group)
