"""Shadow-device audit: on the CPU, catch a host tensor that the GPU path would hand to NCCL.

On the GPU the default process group is NCCL, which takes CUDA tensors only; on the CPU every
group is gloo and every tensor is a CPU tensor, so a multi-process CPU test cannot see a collective
that the GPU path would feed a host tensor ("No backend type associated with device type cpu").
Inside `shadow_devices()` each tensor also carries the device the GPU path would give it:

- host: made by a factory with no device or a CPU one (`torch.tensor(...)`, `torch.zeros(n)`),
  by `.cpu()` / `.to("cpu")`, or by an op whose tensor inputs are all host;
- CUDA: everything else. Made with a CUDA device (`device="cuda"`, `"cuda:N"`, an index,
  `torch.cuda.current_device()`, `x.device` of a CUDA tensor), by `.cuda()` / `.to("cuda")`, by an
  op with a CUDA input, or out of sight of Python (autograd's gradients, which the GPU path makes
  on the parameters' device). Unseen origins count as CUDA, so the audit can miss a host tensor
  but never invents one.

The tag belongs to the storage, so views, `.data`, `nn.Parameter(t)` and in-place ops keep it;
`.cuda()` / `.cpu()` copy where the GPU path copies. `x.device` answers a shadow-CUDA device (a
CPU device object that the audit recognises), so `torch.empty(n, device=x.device)` stays CUDA.
ftcore's own collectives go through runtime/collectives.py, which asks this audit where each tensor
would live and refuses a host tensor on a group that is NCCL on a GPU cluster, and a device tensor
inside an object collective's object. Every other torch.distributed tensor collective and
point-to-point call (megatron's) is checked here the same way: a host tensor on a group whose
GPU-path backend takes CUDA tensors only raises `HostTensorInCollective` with the call site. Groups
created with a gloo backend (megatron's `*_gloo` groups) take host tensors, as they do on the GPU
(collectives.gpu_backend). Not checked here: P2POp lists built from the wrapped isend/irecv, which
torch refuses (the CPU path's p2p is unbatched).

It also records each blocking host-to-device copy (`blocking_copies()`): `.to(cuda)`, `.cuda()` or
`copy_` of a host tensor into a CUDA one without `non_blocking=True`, and a CUDA tensor made from
Python data (`torch.tensor(values, device="cuda")`, `cuda_tensor.new_tensor(values)`), each a host
sync on a GPU
(tests/unit/training/test_host_sync.py's rule; tests/gpu/test_host_sync.py counts the real ones).

The mode replaces the CPU runtime's CUDA-to-CPU rewriting (`cpu.device_mode` and
`cpu.mode_suspended` do nothing inside it) and costs Python time on every torch call: tests only.
megatron builds its weights as on a GPU (`use_cpu_initialization` off, models/llama.py), so they
are CUDA-born. The math is unchanged: the same ops run on the same CPU tensors.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ftcore.runtime import collectives, cpu
from ftcore.runtime import dist as rdist

# What torch.cuda.current_device() and a CUDA tensor's .device answer in the audit: a CPU device
# (so code outside the mode, like a Python backward, still runs on the CPU) that the mode knows
# by identity as the shadow CUDA device.
SHADOW_CUDA = torch.device("cpu")

_active = False
# storages the GPU path would keep in host memory, with where each was made
_host: dict[int, tuple[StorageWeakRef, str]] = {}
_copies: list[str] = []  # call sites of blocking host-to-device copies, in order
# storages explicitly placed on the GPU (a CUDA device named, .cuda(), .to(cuda)): what an object
# collective must not pickle. Derived tensors are not tracked (a miss, never an invention).
_placed: dict[int, StorageWeakRef] = {}
_DEVICE_GET = torch.Tensor.device.__get__
_TORCH = os.sep + "torch" + os.sep
_SKIP = tuple(os.sep + os.path.join("runtime", n) for n in ("device_audit.py", "cpu.py"))
_TENSOR_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "_all_gather_base", "_reduce_scatter_base",
)  # fmt: skip


HostTensorInCollective = collectives.HostTensorInCollective


def active() -> bool:
    return _active


def _key(t: torch.Tensor) -> int | None:
    try:
        with torch._C.DisableTorchFunction():
            return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None  # no storage (meta, wrapper subclasses): counted as CUDA


def host_origin(t: torch.Tensor) -> str | None:
    """Where the tensor's host storage was made, or None if the GPU path keeps it on the device."""
    k = _key(t)
    entry = _host.get(k) if k is not None else None
    if entry is None:
        return None
    if entry[0].expired():  # the storage died; its address may come back for another
        del _host[k]
        return None
    return entry[1]


def placed_on_device(t: torch.Tensor) -> bool:
    """Whether the tensor's storage was explicitly put on the GPU (and is not a host one)."""
    k = _key(t)
    ref = _placed.get(k) if k is not None else None
    return ref is not None and not ref.expired() and not is_host(t)


def _mark_placed(t: torch.Tensor) -> None:
    k = _key(t)
    if k is None:
        return
    if len(_placed) > 4096:  # drop the dead ones now and then
        for dead in [k for k, r in _placed.items() if r.expired()]:
            del _placed[dead]
    with torch._C.DisableTorchFunction():
        _placed[k] = StorageWeakRef(t.untyped_storage())


def is_host(t: torch.Tensor) -> bool:
    """Whether the GPU path would keep this tensor in host memory."""
    return host_origin(t) is not None


def _mark_host(t: torch.Tensor) -> None:
    k = _key(t)
    if k is not None:
        with torch._C.DisableTorchFunction():
            _host[k] = (StorageWeakRef(t.untyped_storage()), _call_site())


def _is_cuda(d) -> bool:
    if d is SHADOW_CUDA:
        return True
    if isinstance(d, bool) or d is None:
        return False
    if isinstance(d, int):
        return True  # device=0 means cuda:0
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, torch.device) and d.type == "cuda"


def _is_device(a) -> bool:
    return isinstance(a, str | torch.device) or (isinstance(a, int) and not isinstance(a, bool))


class ShadowDeviceMode(TorchFunctionMode):
    """Runs every op on the CPU and tags its outputs with their GPU-path device (module doc)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == _DEVICE_GET:  # a new method-wrapper per access: equal, not identical
            t = args[0]
            return func(t) if is_host(t) else SHADOW_CUDA
        if getattr(func, "__name__", "") == "__get__":
            return func(
                *args, **kwargs
            )  # .grad, .data, .T...: a tensor that exists, tagged already
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # megatron's grad-clip check wants CUDA type names, as cpu.py's mode
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if _blocking_h2d(func, args, kwargs):
            _copies.append(_call_site())
        want = None  # "cuda" / "host" when the call names a device; else the inputs decide
        if kwargs.get("device") is not None:
            want = "cuda" if _is_cuda(kwargs["device"]) else "host"
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            want, func, args, kwargs = "cuda", (lambda t, *a, **k: t), args[:1], {}
        elif func in (torch.Tensor.cpu, torch.Tensor.pin_memory):
            want = "host"
        elif func is torch.Tensor.to:
            rest = []
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    want = "host" if is_host(a) else "cuda"
                elif _is_device(a):
                    want = "cuda" if _is_cuda(a) else "host"
                    a = "cpu"
                rest.append(a)
            args = (args[0], *rest)
        out = func(*args, **kwargs)
        return _tag(out, args, kwargs, want)


def _blocking_h2d(func, args, kwargs) -> bool:
    """A copy from host memory into a CUDA tensor that the host waits for on a GPU."""
    asked = kwargs.get("non_blocking", False) or any(a is True for a in args[1:])
    if func is torch.Tensor.copy_:
        src = args[1] if len(args) > 1 else kwargs.get("src")
        return isinstance(src, torch.Tensor) and is_host(src) and not is_host(args[0]) and not asked
    if func is torch.Tensor.__setitem__:  # a 0-dim host value is read as a number: no copy
        v = args[2]
        return isinstance(v, torch.Tensor) and v.dim() > 0 and is_host(v) and not is_host(args[0])
    if func is torch.Tensor.cuda:
        return is_host(args[0]) and not asked
    if func is torch.Tensor.to:
        to_cuda = _is_cuda(kwargs.get("device")) or any(
            (not is_host(a)) if isinstance(a, torch.Tensor) else (_is_device(a) and _is_cuda(a))
            for a in args[1:]
        )
        return to_cuda and is_host(args[0]) and not asked
    if func in (torch.tensor, torch.as_tensor) and _is_cuda(kwargs.get("device")):
        data = args[0] if args else kwargs.get("data")  # Python data, or a host tensor
        return not isinstance(data, torch.Tensor) or is_host(data)
    if func is torch.Tensor.new_tensor:  # Python data onto the tensor's device, unless one named
        data, device = args[1], kwargs.get("device")
        onto_cuda = _is_cuda(device) if device is not None else not is_host(args[0])
        return onto_cuda and (not isinstance(data, torch.Tensor) or is_host(data))
    return False


def _tag(out, args, kwargs, want):
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    in_keys = {_key(t) for t in inputs}
    if isinstance(out, torch.Tensor) and want is not None and _key(out) in in_keys:
        if is_host(out) != (want == "host"):
            out = out.clone()  # .cuda() of a host tensor (or .cpu() of a CUDA one) copies on a GPU
        else:
            if want == "cuda":
                _mark_placed(out)
            return out
    host = want == "host" if want is not None else all(is_host(t) for t in inputs)
    for o in tree_flatten(out)[0]:
        if isinstance(o, torch.Tensor) and _key(o) not in in_keys:
            if host:
                _mark_host(o)  # a new storage; views and in-place results keep their input's tag
            elif want == "cuda":
                _mark_placed(o)
    return out


def _call_site() -> str:
    """The innermost frame outside torch and this module: who made (or sent) the tensor."""
    f = sys._getframe(1)
    while f is not None and (
        f.f_code.co_filename.endswith(_SKIP) or _TORCH in f.f_code.co_filename
    ):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}" if f else "?"


def blocking_copies() -> list[str]:
    """Call sites of the blocking host-to-device copies since the audit began (or `reset`)."""
    return list(_copies)


def reset_copies() -> None:
    _copies.clear()


def _check(name: str, group, tensors) -> None:
    collectives.refuse_host_tensors(name, group, tensors, site=f" at {_call_site()}")


def _checked(name: str, fn):
    sig = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        tensors = tree_flatten([v for k, v in bound.arguments.items() if k != "group"])[0]
        _check(name, bound.arguments.get("group"), tensors)
        return fn(*args, **kwargs)

    return wrapper


def _checked_batch(fn):
    def wrapper(p2p_op_list, *args, **kwargs):
        for op in p2p_op_list:
            _check("batch_isend_irecv", op.group, [op.tensor])
        return fn(p2p_op_list, *args, **kwargs)

    return wrapper


def _recording(fn):
    sig = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        group = fn(*args, **kwargs)
        backend = sig.bind(*args, **kwargs).arguments.get("backend")
        if backend is not None and "gloo" in str(backend).lower():
            collectives.record_gloo_group(group)
        return group

    return wrapper


@contextlib.contextmanager
def shadow_devices():
    """Audit every collective in this block against the GPU path's devices (module doc). Enter it
    before megatron's parallel state is built, so that its gloo groups are known; ftcore's
    collectives must get their device from `rdist.comm_device()`, which is CUDA in the audit as
    init_distributed makes it under NCCL."""
    global _active
    if _active:
        raise RuntimeError("shadow_devices() does not nest")
    saved = {
        name: getattr(dist, name)
        for name in (*_TENSOR_COLLECTIVES, "batch_isend_irecv", "new_group")
    }
    current_device = torch.cuda.current_device
    previous_comm = rdist.set_comm_device(SHADOW_CUDA, shadow=True)
    for name in _TENSOR_COLLECTIVES:
        setattr(dist, name, _checked(name, saved[name]))
    dist.batch_isend_irecv = _checked_batch(saved["batch_isend_irecv"])
    dist.new_group = _recording(saved["new_group"])
    torch.cuda.current_device = lambda: SHADOW_CUDA
    collectives._shadow_host, collectives._shadow_placed = host_origin, placed_on_device
    # this mode rewrites CUDA devices as the CPU runtime's does, and must see every call: the
    # runtime's own mode (which would hide the devices from it) and its suspension stay off
    device_mode, mode_suspended = cpu.device_mode, cpu.mode_suspended
    cpu.device_mode = cpu.mode_suspended = contextlib.nullcontext
    _active = True
    try:
        with ShadowDeviceMode():
            yield
    finally:
        _active = False
        cpu.device_mode, cpu.mode_suspended = device_mode, mode_suspended
        for name, fn in saved.items():
            setattr(dist, name, fn)
        torch.cuda.current_device = current_device
        rdist.set_comm_device(previous_comm)
        collectives._shadow_host = collectives._shadow_placed = None
        _host.clear()
        _placed.clear()
        _copies.clear()
