"""What the overlap options and manual GC need from the training loop (docs/gpu_speed.md).

- overlap_grad_reduce: megatron's schedule starts each chunk's bucket reduction itself when the
  model config carries `grad_sync_func` (as megatron's own training loop wires it).
- overlap_param_gather: the optimizer step no longer all-gathers the updated parameters; each
  bucket's gather starts in the next forward (DDP's pre-hooks, or `param_sync_func` under
  interleaving). Whatever reads the weights between steps (checkpoint, export, tests) calls
  `models.builder.params_current` first.
- perf.manual_gc: Python's collector off during steps (a collection pausing one rank stalls every
  rank waiting for it in a collective); all ranks collect together every interval steps.
"""

from __future__ import annotations

import gc


def wire(config, model: list, cfg) -> None:
    """Set megatron's grad/param sync hooks on the shared model config for the overlap options."""
    p = cfg.parallel

    def one_or_list(fns):
        return fns if len(fns) > 1 else fns[0]

    if p.overlap_grad_reduce:
        config.grad_sync_func = one_or_list([m.start_grad_sync for m in model])
    if model[0].ddp_config.align_param_gather:
        config.param_sync_func = one_or_list([m.start_param_sync for m in model])


class Collector:
    """perf.manual_gc: `gc.disable()` for the run; `step(n)` collects on every rank at the same
    step boundaries (every manual_gc_interval steps; 0: only where `collect()` is called)."""

    def __init__(self, cfg) -> None:
        self.on = bool(cfg.perf.manual_gc)
        self.interval = int(cfg.perf.manual_gc_interval)
        self.collections = 0
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> Collector:
        if self.on:
            gc.disable()
            self.collect()
        return self

    def step(self, n: int) -> None:
        if self.on and self.interval and n % self.interval == 0:
            self.collect()

    def collect(self) -> None:
        if self.on:
            gc.collect()
            self.collections += 1

    def __exit__(self, *exc) -> None:
        if self.on and self._was_enabled:
            gc.enable()
