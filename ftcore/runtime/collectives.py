"""The one door for ftcore's own collectives (docs/gpu_path.md, "The collectives door").

Every `torch.distributed` collective that ftcore issues goes through a function here, named and
shaped as torch's own (tests/unit/runtime/test_collectives_door.py allows no other call outside
ftcore/runtime/). The door knows the backend each group has on a GPU cluster, and refuses a tensor
that backend would not take, with the call and the fix, before NCCL's own "No backend type
associated with device type cpu":

- the default group and megatron's groups are NCCL on a GPU cluster, which takes CUDA tensors only;
  megatron's `*_gloo` groups (their description says GLOO) and groups made with backend gloo
  (`new_group` here, or megatron's) are gloo there too, which takes host tensors;
- a tensor's device: its real one on a GPU run; on the CPU, where every group is gloo and every
  tensor a host tensor, the device the GPU path would give it, known only inside the device audit
  (runtime/device_audit.py sets `_shadow_host`); a CPU run outside the audit checks nothing;
- object collectives pickle their object into a byte tensor on `torch.cuda.current_device()`
  under NCCL (torch's `_get_object_coll_device`): the door checks that this is the rank's own
  device (init_distributed sets it before the group exists), and refuses an object holding a
  device tensor, which the receiving rank would unpickle onto the sender's device index (in the
  audit: a tensor explicitly put on the GPU; one made out of its sight is let through).

What it cannot see: megatron-core's, Transformer Engine's and torch's own collectives (the audit
wraps torch.distributed's functions for those, in tests only), what an object's pickling
contains beyond lists, tuples, sets and dicts, and a wrong group (the right device on the wrong
ranks).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ftcore.runtime import dist as rdist

GLOO = "gloo"
# groups created with a gloo backend (new_group, the device audit); weak: a destroyed group goes
_gloo_groups: weakref.WeakSet = weakref.WeakSet()
# Set by the device audit while it runs: tensor -> where the GPU path would keep it on the host
# (None: on the GPU), and tensor -> whether it was explicitly put on the GPU.
_shadow_host = None
_shadow_placed = None


class HostTensorInCollective(RuntimeError):
    """A collective got a tensor its group's GPU-cluster backend would not take (an ftcore bug)."""


def record_gloo_group(group) -> None:
    """Remember a group created with backend gloo (it takes host tensors on a GPU cluster too)."""
    if isinstance(group, dist.ProcessGroup):  # not a rank's "not a member" marker
        _gloo_groups.add(group)


def new_group(ranks=None, backend=None, **kwargs):
    """torch's new_group; a gloo group is remembered as one."""
    group = dist.new_group(ranks, backend=backend, **kwargs)
    if backend is not None and GLOO in str(backend).lower():
        record_gloo_group(group)
    return group


def _nccl_run() -> bool:
    """A real GPU run: the default group is NCCL (not the CPU runtime's gloo or a dry build's
    fake group)."""
    return dist.is_initialized() and dist.get_backend() == rdist.GPU_BACKEND


def gpu_backend(group=None) -> str:
    """The backend `group` has on a GPU cluster: its own on a GPU run; elsewhere gloo for a group
    made with backend gloo (megatron names its gloo groups *_GLOO), else the default's (NCCL)."""
    if _nccl_run():
        return str(dist.get_backend(group))
    if group is None or group is dist.group.WORLD:
        return rdist.GPU_BACKEND
    desc = str(getattr(group, "group_desc", "") or "")
    if group in _gloo_groups or GLOO in desc.lower():
        return GLOO
    return rdist.GPU_BACKEND


def takes_host(group=None) -> bool:
    """Whether `group` takes host tensors on a GPU cluster."""
    return GLOO in gpu_backend(group).lower()


def host_origin(t: torch.Tensor) -> str | None:
    """Where the tensor lives on the host on the GPU path ("the host", or the audit's call site of
    its making), or None: on the device, or unknown (a CPU run outside the audit)."""
    if _shadow_host is not None:
        return _shadow_host(t)
    if _nccl_run() and t.device.type == "cpu":
        return "the host"
    return None


def _check(call: str, group, tensors) -> None:
    if _shadow_host is None and not _nccl_run():
        return  # a CPU run outside the audit: every tensor a host tensor, right for gloo
    refuse_host_tensors(call, group, tensors)


def refuse_host_tensors(call: str, group, tensors, site: str = "") -> None:
    """Raise for a host tensor bound for a group that takes CUDA tensors only: this door's check,
    and the device audit's for the collectives megatron calls itself (`site`: where it was sent)."""
    if takes_host(group):
        return
    for t in tensors:
        origin = host_origin(t) if isinstance(t, torch.Tensor) else None
        if origin is not None:
            raise HostTensorInCollective(
                f"{call} on a {gpu_backend(group)} group got a host tensor {tuple(t.shape)} "
                f"{t.dtype}{site} (made at {origin}): {gpu_backend(group)} takes CUDA tensors "
                "only. Fix: make it on ftcore.runtime.dist.comm_device() (device=comm_device(), "
                "or .to(comm_device())), or send it over one of megatron's *_gloo groups"
            )


def _tensors_in(obj, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 8 and isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors_in(k, depth + 1)
            yield from _tensors_in(v, depth + 1)
    elif depth < 8 and isinstance(obj, list | tuple | set | frozenset):
        for v in obj:
            yield from _tensors_in(v, depth + 1)


def _on_device(t: torch.Tensor) -> bool:
    """On a GPU run its real device; in the audit, only a tensor explicitly put on the GPU (one
    made out of its sight, like an RNG state, is not counted); otherwise unknown: no."""
    if _shadow_placed is not None:
        return _shadow_placed(t)
    return _nccl_run() and t.device.type != "cpu"


def _check_object(call: str, group, obj) -> None:
    if _nccl_run() and not takes_host(group):
        here, mine = torch.cuda.current_device(), rdist.comm_device()
        if mine.type == "cuda" and here != mine.index:
            raise HostTensorInCollective(
                f"{call} under NCCL pickles into a tensor on the current CUDA device, cuda:{here}, "
                f"but this rank's device is {mine}. Fix: torch.cuda.set_device(local rank) before "
                "the process group exists (ftcore.runtime.dist.init_distributed does)"
            )
    for t in _tensors_in(obj):
        if _on_device(t):
            raise HostTensorInCollective(
                f"{call} got an object holding a device tensor {tuple(t.shape)} {t.dtype}: it is "
                "pickled with its device, and the receiving rank unpickles it onto the sender's "
                "device index. Fix: .cpu() it before the call (or use a tensor collective)"
            )


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    _check("all_reduce", group, [tensor])
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather(tensors: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op=False):
    _check("all_gather", group, [tensor, *tensors])
    return dist.all_gather(tensors, tensor, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    _check("broadcast", group, [tensor])
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def barrier(group=None) -> None:
    """No tensor of ftcore's: under NCCL torch's barrier runs on the device init_distributed bound
    (device_id), so it needs no check."""
    dist.barrier(group=group)


def all_gather_object(objects: list, obj, group=None) -> None:
    _check_object("all_gather_object", group, obj)
    dist.all_gather_object(objects, obj, group=group)


def gather_object(obj, objects: list | None = None, dst: int = 0, group=None) -> None:
    _check_object("gather_object", group, obj)
    dist.gather_object(obj, objects, dst=dst, group=group)


def broadcast_object_list(objects: list, src: int = 0, group=None) -> None:
    _check_object("broadcast_object_list", group, objects)  # on the others: placeholders
    dist.broadcast_object_list(objects, src=src, group=group)


def broadcast_object(obj, src: int = 0):
    """`obj` of rank `src` on every rank (itself alone, or without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    broadcast_object_list(box, src=src)
    return box[0]
