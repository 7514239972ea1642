"""Stop requests: SIGTERM/SIGUSR1/SIGINT, a stop file written by a launcher, or run.max_time.

Handlers only set a flag (a second Ctrl-C aborts without saving: KeyboardInterrupt, exit 130); the ranks agree at each step boundary through one all-reduce, so every
rank saves the same step and exits 3 together. torchrun kills workers 30 s after forwarding a signal,
too short for a big checkpoint, so SLURM scripts use the stop file (see docs/slurm.md); ftcore's
own local launcher (runtime/local_launch.py) waits for the save.
"""

from __future__ import annotations

import logging
import shlex
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ftcore.runtime import collectives
from ftcore.runtime import dist as rdist

log = logging.getLogger("ftcore")

_received: list[str] = []
_previous: dict[int, object] = {}
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _handler(signum, frame):
    name = signal.Signals(signum).name
    if signum == signal.SIGINT and name in _received:
        raise KeyboardInterrupt  # the second Ctrl-C: abort now, without saving
    if not _received:
        again = " (Ctrl-C again aborts without saving)" if signum == signal.SIGINT else ""
        log.warning("received %s: will save and stop at the end of this step%s", name, again)
    _received.append(name)


def install(cfg) -> None:
    """Install the handlers (only if run.handle_signals); uninstall() restores the previous ones.
    With handle_signals=false nothing is touched: a signal does what it did before (usually kills)."""
    _received.clear()
    if not cfg.run.handle_signals or _previous:
        return
    for sig in SIGNALS:
        _previous[sig] = signal.signal(sig, _handler)


def uninstall() -> None:
    for sig, prev in _previous.items():
        signal.signal(sig, prev)
    _previous.clear()


def stop_file(cfg, run_dir: Path) -> Path:
    return Path(cfg.run.stop_file) if cfg.run.stop_file else run_dir / "STOP"


def stop_reason(cfg, run_dir: Path, start_time: float) -> str | None:
    """Collective: the reason every rank agrees to stop now, or None."""
    flags = [
        1.0 if _received else 0.0,
        1.0 if stop_file(cfg, run_dir).exists() else 0.0,
        1.0 if cfg.run.max_time and time.time() - start_time >= cfg.run.max_time * 60 else 0.0,
    ]
    t = torch.tensor(flags, device=rdist.comm_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.all_reduce(t, op=dist.ReduceOp.MAX)
    signal_reason = "signal " + ",".join(_received) if _received else "a signal to another rank"
    for flag, reason in zip(
        t.tolist(), (signal_reason, f"stop file {stop_file(cfg, run_dir)}", "run.max_time")
    ):
        if flag:
            return reason
    return None


def consume(cfg, run_dir: Path, rank: int) -> None:
    """After the stop checkpoint is saved: remove the stop file (rank 0), so that the resumed run
    does not stop again at its first step. A launcher re-creates it for its next stop request."""
    path = stop_file(cfg, run_dir)
    if rank == 0 and path.exists():
        path.unlink(missing_ok=True)
        log.info("removed the stop file %s", path)


def resume_command(cfg, module: str = "ftcore.train") -> str:
    """The command that continues this run where it stopped: the user's overrides (run.overrides,
    as given) with this run's directory, whatever launched it (torchrun, srun, ftcore's workers)."""
    kept = [o for o in cfg.run.overrides if not o.lstrip("+~").startswith("run.dir=")]
    return shlex.join(["python", "-m", module, *kept, f"run.dir={cfg.run.dir}"])
