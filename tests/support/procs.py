"""Processes as /proc shows them (no `ss` or `ps` needed): the TCP addresses one listens on, its
children, the processes started with a given argument."""

from __future__ import annotations

import ipaddress
import os
import socket


def _inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out.add(target[len("socket:[") : -1])
    return out


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s little-endian hex address -> its text form."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on (state 0A = LISTEN)."""
    inodes, found = _inodes(pid), []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    addr, port = fields[1].rsplit(":", 1)
                    found.append((_address(addr), int(port, 16)))
    return found


def off_loopback(pids) -> list[tuple[int, str, int]]:
    """(pid, address, port) of each listening socket of `pids` that another machine can reach."""
    bad = []
    for pid in pids:
        for addr, port in listening(pid):
            ip = ipaddress.ip_address(addr)
            mapped = getattr(ip, "ipv4_mapped", None)
            if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)):
                bad.append((pid, addr, port))
    return bad


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
    return sorted(kids)


def running_with(arg: str) -> list[int]:
    """Live processes (other than this one) with `arg` among their command-line arguments."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if arg.encode() in args and alive(int(entry)):
            found.append(int(entry))
    return sorted(found)


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it no longer runs)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


HOST = socket.gethostname()
