"""`launcher.nproc_per_node=N` on one machine: start N workers, forward stop signals, wait.

Not torch elastic: elastic turns a signal into a `SignalException` traceback and its own exit 1,
and kills the workers 30 s after forwarding it, too short to save a big checkpoint. Here the
workers run in their own sessions (a terminal's Ctrl-C reaches this process only) and each
SIGINT/SIGTERM/SIGUSR1 is forwarded once: the first Ctrl-C makes every worker save and exit 3, a
second one aborts them. A stop waits as long as the save takes; a crash takes the others down.
If this process dies without a word (SIGKILL, the OOM killer, SIGHUP), the kernel sends each
worker SIGTERM (runtime/parent_death.py): they save and stop too.

The rendezvous store listens on the loopback address only (torch's TCPStore binds every interface
unless handed a socket), on a port the kernel picks; gloo's own sockets stay on loopback too
(GLOO_SOCKET_IFNAME), so nothing of a local run is reachable from another machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from ftcore.runtime import parent_death, run_lock

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
ADDR = "127.0.0.1"


def loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux), for gloo's GLOO_SOCKET_IFNAME."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return "lo" if "lo" in names else None


def loopback_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with gloo bound to the loopback interface, unless the user chose one."""
    lo = loopback_interface()
    if lo and "GLOO_SOCKET_IFNAME" not in env:
        env = dict(env, GLOO_SOCKET_IFNAME=lo)
    return env


def loopback_store(world: int) -> dist.TCPStore:
    """A TCPStore listening on 127.0.0.1 only, on a port the kernel picked as it bound. torch's
    store would listen on every interface (`::`) whatever host it is given; handed a socket
    already bound (master_listen_fd), it listens where that socket is."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((ADDR, 0))
        sock.listen(max(128, world))
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(ADDR, port, world, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.detach())  # fmt: skip


def worker_env(base: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """torchrun's variables for one worker; the ranks join this process's store as clients."""
    return dict(
        loopback_env(base),
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


def run(
    module: str,
    argv: list[str],
    nproc: int,
    errors: Path,
    grace: float = 30.0,
    lock: run_lock.Held | None = None,
) -> int:
    """Run `python -u -m module argv` as `nproc` ranks; the status of docs/design.md: 2 if a worker
    refused (its line printed once), 3 if every worker ended with 0 or 3 and one with 3, 0 if all
    finished, else the first failure's. With `lock` (the run directory's, run_lock.acquire), every
    worker inherits the locked file: the run.dir stays locked until the last of them is gone."""
    # bound before any worker starts: a port picked free and bound later can be taken meanwhile
    store = loopback_store(nproc)
    cmd = [sys.executable, "-u", "-m", module, *argv]
    base = dict(os.environ)
    keep: tuple[int, ...] = ()
    if lock is not None:
        base[run_lock.INHERITED_ENV], keep = str(lock.fd), (lock.fd,)
    procs = [
        subprocess.Popen(
            cmd,
            env=worker_env(base, r, nproc, store.port),
            start_new_session=True,
            pass_fds=keep,
            preexec_fn=parent_death.preexec(),
        )  # fmt: skip
        for r in range(nproc)
    ]
    if lock is not None:
        run_lock.note(workers=[p.pid for p in procs])
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
