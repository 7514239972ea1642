"""`launcher.nproc_per_node=N` on one machine: start N workers, forward stop signals, wait.

Not torch elastic: elastic turns a signal into a `SignalException` traceback and its own exit 1,
and kills the workers 30 s after forwarding it, too short to save a big checkpoint. Here the
workers run in their own sessions (a terminal's Ctrl-C reaches this process only) and each
SIGINT/SIGTERM/SIGUSR1 is forwarded once: the first Ctrl-C makes every worker save and exit 3, a
second one aborts them. A stop waits as long as the save takes; a crash takes the others down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
ADDR = "127.0.0.1"


def worker_env(base: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """torchrun's variables for one worker; the ranks join this process's store as clients."""
    return dict(
        base,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        MASTER_ADDR=ADDR,
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
    )


def status_of(code: int) -> int:
    """Popen returncode -> shell-style status (128 + signal when killed)."""
    return 128 - code if code < 0 else code


def run(module: str, argv: list[str], nproc: int, errors: Path, grace: float = 30.0) -> int:
    """Run `python -u -m module argv` as `nproc` ranks; the status of docs/design.md: 2 if a worker
    refused (its line printed once), 3 if every worker ended with 0 or 3 and one with 3, 0 if all
    finished, else the first failure's."""
    # bound before any worker starts: a port picked free and bound later can be taken meanwhile
    store = dist.TCPStore(ADDR, 0, nproc, is_master=True, wait_for_workers=False)
    cmd = [sys.executable, "-u", "-m", module, *argv]
    base = dict(os.environ)
    procs = [
        subprocess.Popen(cmd, env=worker_env(base, r, nproc, store.port), start_new_session=True)
        for r in range(nproc)
    ]
    got: list[int] = []

    def forward(signum, _frame):
        got.append(signum)
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and got.count(signal.SIGINT) == 1:
            print("ftcore: Ctrl-C: the workers save a checkpoint and stop (Ctrl-C again aborts "
                  "without saving)", file=sys.stderr, flush=True)  # fmt: skip
        elif signum == signal.SIGINT:
            print("ftcore: second Ctrl-C: aborting without saving", file=sys.stderr, flush=True)
        else:
            print(f"ftcore: got {name}, sent to the workers", file=sys.stderr, flush=True)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        codes = _supervise(procs, grace)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        del store
    if 2 in codes:
        _print_first_error(errors)
        return 2
    bad = [c for c in codes if c not in (0, 3)]
    if bad:
        return bad[0]
    return 3 if 3 in codes else 0


def _supervise(procs: list[subprocess.Popen], grace: float) -> list[int]:
    """Wait for every worker. One that fails (not 0 or 3) takes the others down: TERM (they
    save and stop), then KILL after `grace` seconds, so a crash never leaves ranks hanging."""
    kill_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [status_of(c) for c in codes]
        failed = [c for c in codes if c is not None and c not in (0, 3)]
        if failed and kill_at is None:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            kill_at = time.monotonic() + grace
        if kill_at is not None and time.monotonic() > kill_at:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)


def _print_first_error(errors: Path) -> None:
    """The lowest rank's error line (every rank usually finds the same one)."""
    files = sorted(errors.glob("rank*"), key=lambda f: int(f.name[4:]))
    if files:
        print(files[0].read_text().strip(), file=sys.stderr, flush=True)
