"""One live run per run directory: an exclusive flock on `<run.dir>/run.lock`.

Two starts in one run.dir (a second terminal, or a restart while the first run's workers still
save) would write the same checkpoints and metrics. The lock is taken before anything expensive
is built, by whatever runs the ranks: ftcore's local launcher (its workers inherit the locked file,
so the lock lives until the last of them exits) or rank 0 under torchrun/srun. The kernel drops a
flock when the last process holding the file is gone, however it died (SIGKILL, the OOM killer):
there is never a stale lock to clear. The file says who holds it (pid, host, start time, workers),
which the refusal names (exit 2).

The file exists while a run holds it (or after one was killed): a run that ends removes it, and
the directory the lock created if nothing else was written (a run that failed in setup leaves
nothing). A file system without flock (some Lustre mounts) gets a warning and no lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files

log = logging.getLogger("ftcore")

LOCK_NAME = "run.lock"
# "<fd>": set by the local launcher for its workers, whose inherited descriptor holds the lock
INHERITED_ENV = "FTCORE_RUN_LOCK_FD"
NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL)


@dataclass
class Held:
    path: Path
    fd: int
    created_dir: bool  # the run directory did not exist before this lock
    said: dict = field(default_factory=dict)  # what the file says about the holder


_held: Held | None = None


def acquire(run_dir: str | Path) -> Held | None:
    """Lock `run_dir` for this process (and the children it passes `fd` to); FtcoreError naming
    the holder when a live run has it. None (a warning) where the file system has no flock."""
    global _held
    run_dir = Path(run_dir)
    created = _make_dir(run_dir)
    path = run_dir / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:  # a symlink or another user's file at its name
            raise FtcoreError(f"{path} cannot be opened as this run's lock ({e.strerror})",
                              field="run.dir", fix="a run directory of your own: run.dir=<a new "
                              "directory>") from e  # fmt: skip
        try:
            if os.fstat(fd).st_uid != os.getuid():
                raise FtcoreError(
                    f"{path} belongs to user id {os.fstat(fd).st_uid}, not to you",
                    field="run.dir",
                    fix="a run directory of your own: run.dir=<a new directory>",
                )
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(fd)
            os.close(fd)
            raise FtcoreError(
                f"{run_dir} is in use by a live run ({holder})",
                field="run.dir",
                fix="wait for that run to end, or stop it (kill -INT <its pid>: it saves and exits "
                "3), or give another run.dir",
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno in NO_FLOCK:
                log.warning("%s: the file system does not support locks (%s): nothing stops a "
                            "second run from using this run.dir at the same time", path, e)  # fmt: skip
                return None
            raise
        except BaseException:
            os.close(fd)
            raise
        # Locked, but a run that was ending may have removed the file in between: then this lock
        # is on a name nobody else can find; take it again on the file that is there now.
        try:
            same = os.path.samestat(os.fstat(fd), os.lstat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
        created = _make_dir(run_dir) or created
    _held = Held(path, fd, created)
    note(pid=os.getpid(), host=socket.gethostname(),
         started=time.strftime("%Y-%m-%d %H:%M:%S %Z"))  # fmt: skip
    return _held


def note(**fields) -> None:
    """Add `fields` to what the held lock file says about its holder (e.g. the workers' pids)."""
    if _held is None:
        return
    _held.said.update(fields)
    data = json.dumps(_held.said).encode() + b"\n"
    os.ftruncate(_held.fd, 0)
    os.pwrite(_held.fd, data, 0)


def held(run_dir: str | Path) -> bool:
    """Whether this process holds the lock of `run_dir` (it took it, or inherited it)."""
    if _held is not None and _held.path == Path(run_dir) / LOCK_NAME:
        return True
    return inherited(run_dir)


def inherited(run_dir: str | Path) -> bool:
    """Whether this process runs under its launcher's lock on `run_dir` (INHERITED_ENV names the
    descriptor it inherited, and that descriptor is this directory's lock file)."""
    fd = os.environ.get(INHERITED_ENV, "")
    if not fd.isdigit():
        return False
    try:
        return os.path.samestat(os.fstat(int(fd)), os.lstat(Path(run_dir) / LOCK_NAME))
    except OSError:
        return False


def release() -> None:
    """Drop the lock this process took and its file (a run that ended leaves no run.lock, so a
    refused start leaves the directory as it was), and the run directory if the lock created it
    and nothing else was written (the run failed before writing anything)."""
    global _held
    held, _held = _held, None
    if held is None:
        return
    try:
        held.path.unlink()  # still locked: a start that opened this file retries (acquire)
        if held.created_dir:
            held.path.parent.rmdir()  # only if empty
    except OSError:
        pass
    finally:
        os.close(held.fd)


def _make_dir(run_dir: Path) -> bool:
    """Create the run directory, private (0700); True if this call created it."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(run_dir, 0o700)
        return True
    except FileExistsError:
        return False


def _describe(fd: int) -> str:
    """`pid P on host H, started T (workers ...)` from the lock file, as far as it says."""
    try:  # another run's words: data, read as JSON through the door, never trusted further
        said = safe_files.parse_json(os.pread(fd, 4096, 0), LOCK_NAME, "run.dir")
        pid, host, started = int(said["pid"]), str(said["host"]), str(said["started"])
    except (FtcoreError, ValueError, KeyError, TypeError, OSError):
        return "its holder did not say who it is"
    text = f"pid {pid} on host {host}, started {started}"
    workers = said.get("workers")
    if isinstance(workers, list) and workers:
        text += f", workers {', '.join(str(w) for w in workers)}"
    if host == socket.gethostname() and not pid_alive(pid):
        text += f"; pid {pid} is gone, its workers are still stopping"
    return text


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has that id (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
