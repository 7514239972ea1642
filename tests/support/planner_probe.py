"""Worker-side probes for the planner tests: what megatron actually allocates on this rank.

- model state: parameter storages, DDP gradient buffers, optimizer tensors (fp32 main params and
  the torch optimizer's state) after one step, each deduplicated by storage;
- activations: the peak over one training step of the bytes of tensors autograd holds for
  backward (saved_tensors_hooks, deduplicated by storage, parameters excluded), tracked live with
  weak references so pipeline schedules' in-flight micro-batches show up as they really overlap.
"""

from __future__ import annotations

import weakref

import torch
from megatron.core import parallel_state as ps

from ftcore.models.sharding import unwrap
from ftcore.training import trainer
from tests.support.layouts import build, record_microbatches


def _storage(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _inner_optimizers(opt) -> list:
    subs = getattr(opt, "chained_optimizers", None) or [opt]
    return subs


def model_state_bytes(state) -> dict:
    params = {}
    for chunk in state.model:
        for p in unwrap(chunk).parameters():
            k, n = _storage(p.data)
            params[k] = n
    grads = {}
    for chunk in state.model:
        for p in unwrap(chunk).parameters():
            g = getattr(p, "main_grad", None)
            if g is not None:
                k, n = _storage(g)
                grads[k] = n
    trainer.train_step(state)  # torch's Adam creates its state lazily, on the first step
    taken = set(params) | set(grads)
    opt = {}
    for sub in _inner_optimizers(state.optimizer):
        inner = sub.optimizer
        tensors = [p for g in inner.param_groups for p in g["params"]]
        for st in inner.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            k, n = _storage(t)
            if k not in taken:
                opt[k] = n
    return {
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(with_context_parallel=True),
        "weights": sum(params.values()),
        "grads": sum(grads.values()),
        "optimizer": sum(opt.values()),
    }


def state_case(overrides: list[str], run_dir: str) -> dict:
    return model_state_bytes(build(overrides, run_dir))


def peak_saved_bytes(state) -> int:
    params = set()
    for chunk in state.model:
        for p in unwrap(chunk).parameters():
            params.add(_storage(p.data)[0])
    live: dict[int, tuple[int, list]] = {}
    peak = 0

    def alive() -> int:
        total = 0
        for key in list(live):
            n, refs = live[key]
            if any(r() is not None for r in refs):
                total += n
            else:
                del live[key]
        return total

    def pack(t):
        nonlocal peak
        if isinstance(t, torch.Tensor):
            key, n = _storage(t)
            if key not in params and n:
                entry = live.setdefault(key, (n, []))
                entry[1].append(weakref.ref(t))
                peak = max(peak, alive())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step(state)
    return peak


def activation_case(overrides: list[str], run_dir: str) -> dict:
    """Also the largest share of target positions in a micro-batch of the step: the planner's
    plan.target_fraction for the logits and the last layer's MLP."""
    state = build(overrides, run_dir)
    mbs = record_microbatches(state)
    saved = peak_saved_bytes(state)
    return {"pp_rank": ps.get_pipeline_model_parallel_rank(), "saved": saved,
            "target_fraction": max(float(mb.loss_mask.mean()) for mb in mbs)}  # fmt: skip
