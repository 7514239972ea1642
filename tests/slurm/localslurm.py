"""A real SLURM (Debian's slurm-wlm 22.05 + munge) on this one machine, with two `slurmd -N` nodes.

Everything lives in one temporary directory: a private munge socket, the config, state, spool, logs
and pid files, on ports picked free at start, so two test sessions on one machine do not collide.
Daemons are stopped by the PIDs in their pid files, never by name. Also runnable by hand:
`python tests/slurm/localslurm.py up DIR` / `down DIR` (then `export SLURM_CONF=DIR/slurm.conf`).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
NODES = ["node1", "node2"]


class Unavailable(Exception):
    """SLURM cannot run here (packages not installable, not root): the tests skip with this reason."""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def ensure_installed() -> None:
    """apt-get install the daemons once (~10 s); raise Unavailable with the reason if impossible."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Unavailable("slurm-wlm/munge are not installed and apt-get as root is not available")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    r = _run(install, env=env)
    if r.returncode != 0:  # the package lists may be missing on a fresh machine
        _run(["apt-get", "update", "-qq"], env=env)
        r = _run(install, env=env)
    if r.returncode != 0:
        raise Unavailable(f"apt-get install {' '.join(PACKAGES)} failed: {r.stderr.strip()[-300:]}")


def _free_port_range(n: int) -> int:
    """A base port such that base..base+n-1 are all free now."""
    for _ in range(200):
        base = random.randint(20000, 32000 - n)  # below the ephemeral ports (32768-60999)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise Unavailable("no free port range for slurmctld/slurmd")


@dataclass
class Cluster:
    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment for sbatch/scontrol/squeue against this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def cmd(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        r = _run(list(args), env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} -> {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def pid_files(self) -> list[Path]:
        return [self.root / f"slurmd-{n}.pid" for n in NODES] + [
            self.root / "slurmctld.pid",
            self.root / "munge" / "munged.pid",
        ]

    def logs(self) -> str:
        """The tails of the daemons' logs, for a failing test's message."""
        out = []
        for f in sorted(self.root.glob("*.log")):
            out.append(
                f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:])
            )
        return "\n".join(out)


def _write_conf(c: Cluster) -> None:
    host = socket.gethostname().split(".")[0]
    base = _free_port_range(2 + len(NODES))
    r = c.root
    munge_sock = r / "munge" / "munge.socket"
    c.conf.write_text(
        f"""# written by tests/slurm/localslurm.py
ClusterName=ftcoretest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={base}
SlurmdPort={base + 1}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_sock},cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerParameters=sched_interval=2,bf_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
MinJobAge=600
KillWait=30
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
NodeName=node[1-{len(NODES)}] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{base + 2}-{base + 1 + len(NODES)}] CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
    )


def _start_munge(c: Cluster) -> None:
    d = c.root / "munge"
    d.mkdir()
    os.chmod(d, 0o755)  # munged wants the socket's directory searchable by all
    shutil.chown(d, "munge", "munge")
    cmd = [
        "runuser", "-u", "munge", "--", "munged",
        f"--socket={d}/munge.socket", f"--pid-file={d}/munged.pid",
        f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed",
    ]  # fmt: skip
    r = _run(cmd)
    if r.returncode != 0:
        raise RuntimeError(f"munged failed: {r.stderr.strip()}")


def up(root: Path, timeout: float = 60) -> Cluster:
    """Start munge, slurmctld and the slurmd nodes; return once every node is idle."""
    ensure_installed()
    c = Cluster(Path(root))
    c.root.mkdir(parents=True, exist_ok=True)
    os.chmod(c.root, 0o755)  # the munge user must reach its socket directory inside
    for sub in ["state", *(f"spool/{n}" for n in NODES)]:
        (c.root / sub).mkdir(parents=True, exist_ok=True)
    _write_conf(c)
    try:
        _start_munge(c)
        c.cmd("slurmctld", "-i", "-f", str(c.conf))
        for n in NODES:
            c.cmd("slurmd", "-f", str(c.conf), "-N", n)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = c.cmd("sinfo", "-h", "-N", "-o", "%N %t", check=False).split()
            if states.count("idle") == len(NODES):
                return c
            time.sleep(0.5)
        raise RuntimeError(f"nodes not idle after {timeout} s: {states}\n{c.logs()}")
    except Exception:
        down(c.root)
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def down(root: Path, timeout: float = 15) -> None:
    """Stop every daemon by the PID in its pid file (TERM, then KILL); leave the files for logs."""
    c = Cluster(Path(root))
    pids = []
    for f in c.pid_files():
        try:
            pid = int(f.read_text().strip())
        except (OSError, ValueError):
            continue
        if pid > 1 and _pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _pid_alive(p)]
        time.sleep(0.2)
    for p in pids:
        os.kill(p, signal.SIGKILL)


def job_info(c: Cluster, job_id: int) -> dict[str, str]:
    """`scontrol show job` as a dict (sacct needs slurmdbd, which is absent)."""
    out = c.cmd("scontrol", "show", "job", "-o", str(job_id))
    info = {}
    for tok in out.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            info[k] = v
    return info


def wait_job(c: Cluster, job_id: int, timeout: float, done=("COMPLETED", "FAILED", "CANCELLED",
             "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")) -> dict[str, str]:  # fmt: skip
    """Poll until the job reaches a final state; return its scontrol record."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(c, job_id)
        if info.get("JobState") in done:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout} s")
        time.sleep(1)


if __name__ == "__main__":
    action, where = sys.argv[1], Path(sys.argv[2])
    if action == "up":
        up(where)
        print(f"export SLURM_CONF={where}/slurm.conf")
    else:
        down(where)
