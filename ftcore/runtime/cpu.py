"""Run megatron-core on CPU (gloo): a test and dry-run backend, inactive whenever CUDA is used
(plus CPU-only speed fixes at the end: the mode left for megatron's backward, all-reduces and
broadcasts over one process skipped, the output layer's gradient layout, fused AdamW).

megatron-core assumes CUDA in two ways (see docs/cpu_runtime.md):
1. calls into `torch.cuda` (current_device, RNG state, streams, synchronize): `activate()` replaces
   them with CPU equivalents once per process; this costs nothing per step.
2. literal `device="cuda"` arguments, `.cuda()` and `Tensor.type() == "torch.cuda.FloatTensor"`
   checks: `device_mode()` is a TorchFunctionMode that rewrites them. It costs Python time on every
   torch call, so ftcore enters it only around model/optimizer construction, megatron's schedule
   (its buffers), the optimizer step and checkpoint I/O, and leaves it for the forward, the loss
   and the backward (`mode_suspended`; measured in the README).

`meta_device()` points the same rewriting at the meta device instead, for the planner's dry build
(ftcore/training/dry_build.py): inside it, ftcore builds as it would on a GPU (`is_active()` is
False) and everything megatron puts on "the GPU" lands on meta, while a tensor created without a
device stays on the CPU, where the dry build finds it.
"""

from __future__ import annotations

import contextlib
import os
import types

import torch
from torch.overrides import TorchFunctionMode

_active = False
_target = "cpu"  # where the mode sends device="cuda": "meta" inside meta_device()
_fake_cuda_gen = torch.Generator()  # stands in for the CUDA generator megatron forks and restores


def is_active() -> bool:
    """True when megatron runs on the CPU (not while a dry build stands in for a GPU)."""
    return _active and _target == "cpu"


def _is_cuda_device(d) -> bool:
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True  # device=0 means cuda:0
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return False


class _Stream:
    """A do-nothing CUDA stream/event: CPU work is synchronous."""

    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def record_event(self, *a, **k):  # megatron's MoE dispatcher synchronises the event later
        return _Stream()

    def __getattr__(self, name):
        return lambda *a, **k: None


class CudaOnCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU (meta in a dry build) and reports CUDA type strings
    (megatron's grad-clip check)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _target
        if (
            func is torch.device and args and _is_cuda_device(args[0])
        ):  # e.g. `with torch.device(0)`
            return torch.device(_target)  # (megatron's YaRN rotary module for MLA)
        if func is torch.Tensor.cuda:  # on a GPU .cuda() moves the tensor; on the CPU it stays
            return args[0] if _target == "cpu" else args[0].to(_target)
        if func is torch.Tensor.to:
            args = tuple(_target if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = func(*args)
            if _target == "cpu":
                return t.replace("torch.", "torch.cuda.", 1) if ".cuda." not in t else t
            # a dry build: a meta tensor stands in for a CUDA one, a CPU tensor stays a CPU one
            return t.replace("torch.meta.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def device_mode():
    """Enter the rewriting mode if the CPU runtime or a dry build is active; a no-op on CUDA."""
    if not _active and _target == "cpu":
        yield
        return
    with CudaOnCpuMode():
        yield


@contextlib.contextmanager
def mode_suspended():
    """Leave the rewriting mode for hot code that needs none of it (the model's forward).

    FTCORE_CPU_MODE_IN_FORWARD=1 keeps it on, to measure what it costs."""
    if not _active or os.environ.get("FTCORE_CPU_MODE_IN_FORWARD") == "1":
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


@contextlib.contextmanager
def meta_device():
    """Build as on a GPU whose memory is the meta device: device="cuda", .cuda() and
    torch.cuda.current_device() all mean meta (which allocates nothing, so a 405B stage builds in
    seconds). The CUDA calls megatron makes are redirected as in `activate()`."""
    global _target
    activate()
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # device 0: a CUDA device, which the mode sends to meta
    _target = "meta"
    try:
        yield
    finally:
        _target = "cpu"
        torch.cuda.current_device = current


def activate(*, hide_cuda: bool = False) -> None:
    """Redirect megatron-core's torch.cuda calls to the CPU. Idempotent; call before any build.

    A no-op where CUDA is available, unless `hide_cuda`: a run told to use the CPU
    (cluster.device=cpu) on a machine with a GPU, which otherwise built megatron's model on
    cuda:0 for every rank over gloo. Then torch.cuda.is_available() answers False for the rest of
    the process, which runs as on a machine without a GPU."""
    global _active
    if _active or (torch.cuda.is_available() and not hide_cuda):
        return
    cuda = torch.cuda
    cuda.is_available = lambda: False
    cuda.current_device = lambda: torch.device("cpu")
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.Stream = _Stream
    cuda.Event = _Stream
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.nvtx = types.SimpleNamespace(range_push=lambda *a: None, range_pop=lambda: None)
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None

    def get_rng_state(device=None):
        return _fake_cuda_gen.get_state()

    def set_rng_state(state, device=None):
        _fake_cuda_gen.set_state(state)

    def manual_seed(seed):
        _fake_cuda_gen.manual_seed(int(seed))

    cuda.get_rng_state = get_rng_state
    cuda.set_rng_state = set_rng_state
    cuda.manual_seed = manual_seed
    cuda.manual_seed_all = manual_seed
    cuda.random.get_rng_state = get_rng_state
    cuda.random.set_rng_state = set_rng_state
    cuda.random.manual_seed = manual_seed

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        get_rng_state()
    )
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: set_rng_state(
        new_state
    )
    _suspend_in_backward()
    _skip_lone_collectives()
    from ftcore.runtime import cpu_moe

    cpu_moe.install(device_mode)  # megatron's MoE layer without TE and CUDA
    _active = True


def _suspend_in_backward() -> None:
    """megatron's backward_step allocates nothing on a device; without the mode, the Python
    backward of its autograd functions (frozen linears, TP regions) runs ~2% faster."""
    from megatron.core.pipeline_parallel import schedules

    backward_step = schedules.backward_step

    def suspended(*args, **kwargs):
        with mode_suspended():
            return backward_step(*args, **kwargs)

    schedules.backward_step = suspended


def _skip_lone_collectives() -> None:
    """An all-reduce or broadcast over a group of one process leaves its tensor as it is, yet
    through gloo each costs 50-100 us: the cross-entropy's three all-reduces over TP 1, DDP's grad
    sync over DP 1 and finalize_model_grads' token-count broadcast over PP 1 are ~0.4 ms of a
    ~50 ms single-process LoRA step. Asynchronous calls keep theirs (their handle is waited)."""
    import torch.distributed as dist

    all_reduce, broadcast = dist.all_reduce, dist.broadcast

    def lone_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not async_op and dist.get_world_size(group) == 1:
            return None
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    def lone_broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        if not async_op and dist.get_world_size(group) == 1:
            return None
        return broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)

    dist.all_reduce, dist.broadcast = lone_all_reduce, lone_broadcast


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the gradient leaves contiguous."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def contiguous_output_grad(output_layer: torch.nn.Module) -> None:
    """GPTModel returns logits.transpose(0, 1), so the output layer's gradient arrives as a
    transposed view; megatron's linear backward (grad_output.matmul(weight)) then runs on CPU as a
    batched matmul over an expanded weight, ~8x slower than one GEMM on a contiguous copy."""

    def hook(module, args, output):
        logits, bias = output
        return _ContiguousGrad.apply(logits), bias

    output_layer.register_forward_hook(hook)


def fused_adam(optimizer) -> None:
    """torch's AdamW as megatron builds it without Apex/TE runs one Python loop per tensor on
    CPU (foreach and fused default to CUDA only); its fused CPU kernel does the same update."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False


def no_dynamo_wrappers() -> None:
    """torch wraps Optimizer.add_param_group, zero_grad, state_dict and load_state_dict in
    `torch._disable_dynamo`, which imports torch._dynamo at the first call only to mark them as
    not to be traced: ~2 s of CPU in every process that builds an optimizer (a fused AdamW of one
    tensor: 2.0 s here). Nothing is compiled on the CPU runtime (runtime/megatron_jit.py), so each
    is given itself as its disabled form, which the wrapper then calls directly. Idempotent."""
    code = torch._disable_dynamo(lambda: None).__code__  # the wrappers' shared inner function
    for f in vars(torch.optim.Optimizer).values():
        if getattr(f, "__code__", None) is code:
            f.__wrapped__.__dynamo_disable = f.__wrapped__


def no_dynamo_step(optimizer) -> None:
    """torch's Adam/AdamW step wrapper imports torch._dynamo at each call to place a graph break
    (~0.9 s of CPU at the first step of every process that trains). Nothing is compiled on the CPU
    runtime: each inner optimizer gets its step as an instance attribute that does what the wrapper
    does without it (grad mode per `differentiable`, then the same update). Where a step hook is
    registered the wrapper is kept: it is what calls them."""
    from torch.optim import optimizer as torch_optimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or "step" in vars(inner):
            continue
        hooks = (torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks,
                 inner._optimizer_step_pre_hooks, inner._optimizer_step_post_hooks)  # fmt: skip
        use_grad = getattr(type(inner).step, "__wrapped__", None)  # under the profile wrapper
        raw = getattr(use_grad, "__wrapped__", None)
        if getattr(use_grad, "__code__", None) is None or raw is None or any(hooks):
            continue
        if use_grad.__code__.co_name != "_use_grad":
            continue  # another torch's wrapping: left as it is
        inner.step = _plain_step(inner, raw)


def _plain_step(inner, raw):
    def step(closure=None):
        with torch.set_grad_enabled(inner.defaults["differentiable"]):
            return raw(inner, closure)

    return step
