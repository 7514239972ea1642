"""This process's host memory from /proc (Linux): the resident set now and its peak since a reset.

Peak RSS counts anonymous and file-backed pages alike, so memory-mapped reads are included: what
the probes in tools/ and the load tests report as a rank's host memory."""

from __future__ import annotations


def status(key: str) -> int:
    """A byte count from /proc/self/status, e.g. "VmRSS" (now) or "VmHWM" (peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> None:
    """Set the peak (VmHWM) to the current RSS, so a later read measures one phase."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
