"""Workers stop with their launcher, however it dies.

A launcher forwards the signals it can catch (runtime/local_launch.py, launch/node.py), but
SIGKILL, the OOM killer or a SIGHUP from a closed terminal end it without a word to its workers,
which run in their own sessions and would go on training, writing checkpoints into a run.dir that
the next start uses too. So each worker asks the kernel (prctl PR_SET_PDEATHSIG, Linux) for
SIGTERM when its launcher dies: that is the trainer's stop request, so the ranks agree at the
next step boundary, save, and exit 3, as after any SIGTERM (runtime/signals.py); before the
training loop installs its handlers SIGTERM ends a worker at once (nothing to save yet).

Set in the child between fork and exec (Popen's preexec_fn); a launcher that died in between is
caught by comparing the parent pid.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
SIGNAL = signal.SIGTERM


def _prctl():
    """libc's prctl, looked up in the launcher (not in the forked child): None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def preexec(also: Callable[[], None] | None = None) -> Callable[[], None]:
    """A Popen preexec_fn: SIGTERM to this child when the calling process dies; `also` runs after."""
    parent, prctl = os.getpid(), _prctl()

    def in_child() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(SIGNAL), 0, 0, 0)
            if os.getppid() != parent:  # the launcher died before the request was in place
                os._exit(128 + int(SIGNAL))
        if also is not None:
            also()

    return in_child
