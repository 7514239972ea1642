"""Timer hooks on a training step, for whatever measures it (ftcore.bench): `TrainState.timers`.

`state.timers` is None unless set; set, it is an object with megatron-core's Timers interface
(`timers(name, log_level=None)` returning a timer with `start()` and `stop()`, as
`megatron.core.timers.Timers`). trainer.train_step times its own phases into it under the names
below, and hands the same object to megatron's schedule for that step (`config.timers`), so
megatron's own timers of the pipeline sends and receives land in it too (`is_p2p`).

Nesting: FWD_BWD is the whole schedule (step.run_batches); GRAD_SYNC (megatron's
finalize_model_grads: DP reduction, SP and embedding all-reduces, the per-token scaling) and the
pipeline sends/receives run inside it. Tensor-parallel collectives run inside the layers' forward
and backward, where megatron offers no timing hook: they stay part of FWD_BWD.
"""

from __future__ import annotations

from contextlib import contextmanager

DATA = "data"  # the loader's next micro-batches
FWD_BWD = "fwd_bwd"  # the forward-backward schedule, all of it
GRAD_SYNC = "grad_sync"  # finalize_model_grads (inside FWD_BWD)
OPTIMIZER = "optimizer"  # found-inf check, grad norm and clipping, the update


def is_p2p(name: str) -> bool:
    """megatron's pipeline send/receive timers ('forward-recv', 'backward-send-forward-recv', ...)."""
    return "send" in name or "recv" in name


@contextmanager
def timed(timers, name: str):
    """Time the block as `name` when timers are set (log level 1: megatron's Timers keeps it)."""
    if timers is None:
        yield
        return
    timers(name, log_level=1).start()
    try:
        yield
    finally:
        timers(name).stop()
