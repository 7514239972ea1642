"""Rendezvous settings derived from SLURM's environment, for one launcher per node.

Why not trust hostnames: on real clusters the node names in SLURM_JOB_NODELIST usually resolve,
but not always (and on the two-slurmd test cluster they never do); the node's `NodeAddr` is what
slurmd itself is reached at, so the master address is the first node's NodeAddr. Without scontrol
(a dry run, a container without the SLURM client) the first node name is used as is.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass

# Ports a rendezvous may take: the unprivileged ones from 10000 up (below, services usually
# listen: SLURM's own 6817-6819, databases, notebooks) outside Linux's default ephemeral range
# (32768-60999), where any outgoing connection (NCCL's, the file system's) may hold the port at the
# moment the rendezvous binds it, failing a start or a requeue with EADDRINUSE: 27304 ports.
PORT_RANGES = ((10000, 32768), (61000, 65536))
PORT_COUNT = sum(hi - lo for lo, hi in PORT_RANGES)
# A per-job secret the batch shell draws at the start of each attempt (slurm/common.sh) and srun
# passes to every node's launcher: the port comes from it, not from public facts (the job id, which
# everyone sees in squeue). Set but empty: a dry run, where the port is chosen when the job starts.
SECRET_ENV = "FTCORE_RENDEZVOUS_SECRET"


@dataclass
class Layout:
    """Where this node sits in the job: everything a per-node launcher needs."""

    job_id: str
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int | None  # None: a dry run; drawn from the job's secret when it starts
    nodes: list[str]

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def as_dict(self) -> dict:
        return {**asdict(self), "world_size": self.world_size}


def expand_hostlist(spec: str) -> list[str]:
    """`gpu[001-003,007],cpu1` -> ['gpu001', 'gpu002', 'gpu003', 'gpu007', 'cpu1'] (SLURM's syntax)."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", spec):
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def job_nodes(env: dict[str, str], use_scontrol: bool = True) -> list[str]:
    spec = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not spec:
        return []
    if use_scontrol and shutil.which("scontrol"):
        r = subprocess.run(["scontrol", "show", "hostnames", spec], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.split():
            return r.stdout.split()
    return expand_hostlist(spec)


def node_addr(name: str, use_scontrol: bool = True) -> str:
    """The address slurmd knows the node by (`NodeAddr`), else the name itself."""
    if use_scontrol and shutil.which("scontrol"):
        r = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True)
        m = re.search(r"\bNodeAddr=(\S+)", r.stdout)
        if r.returncode == 0 and m:
            return m.group(1)
    return name


def gpus_on_node(env: dict[str, str]) -> int | None:
    """GPUs SLURM gave this node: SLURM_GPUS_ON_NODE, else --gpus-per-node ('8' or 'h100:8')."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    per_node = env.get("SLURM_GPUS_PER_NODE", "")
    m = re.fullmatch(r"(?:[\w-]+:)?(\d+)", per_node)
    return int(m.group(1)) if m else None


def master_port(env: dict[str, str]) -> int | None:
    """MASTER_PORT if set; else one drawn from the job's secret (FTCORE_RENDEZVOUS_SECRET, set by
    slurm/common.sh): the same on every node of an attempt, unknown to anyone who only sees the
    job id; None in a dry run (the secret is drawn when the job starts). Without the scripts (a
    bare srun) it falls back to the job id, which others can guess (docs/slurm.md)."""
    if env.get("MASTER_PORT"):
        return int(env["MASTER_PORT"])
    job = env.get("SLURM_JOB_ID", "0")
    if SECRET_ENV in env:
        if not env[SECRET_ENV]:
            return None
        digest = hashlib.sha256(f"{env[SECRET_ENV]}:{job}".encode()).digest()
        return port_at(int.from_bytes(digest[:8], "big"))
    return port_at(int(job) if job.isdigit() else 0)


def port_at(i: int) -> int:
    """The (i mod PORT_COUNT)-th port of PORT_RANGES."""
    i %= PORT_COUNT
    for lo, hi in PORT_RANGES:
        if i < hi - lo:
            return lo + i
        i -= hi - lo
    raise AssertionError("unreachable")


def from_env(
    env: dict[str, str] | None = None, nproc_per_node: int | None = None, use_scontrol: bool = True
) -> Layout:
    """The layout of this node from SLURM's variables (one launcher task per node).

    Outside SLURM it is a single node: rank 0 of 1, master 127.0.0.1. `use_scontrol=False` (dry
    runs) takes node names as they are instead of asking the controller.
    """
    env = dict(os.environ if env is None else env)
    nodes = job_nodes(env, use_scontrol)
    nnodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or len(nodes) or 1)
    node_rank = int(env.get("SLURM_NODEID", "0"))
    if nproc_per_node is None:
        nproc_per_node = gpus_on_node(env) or 1
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"]
    elif nodes:
        addr = node_addr(nodes[0], use_scontrol)
    else:
        addr = "127.0.0.1"
    return Layout(
        job_id=env.get("SLURM_JOB_ID", "local"),
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc_per_node,
        master_addr=addr,
        master_port=master_port(env),
        nodes=nodes or ["localhost"],
    )


def cpus_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Defaults a user's environment may override (setdefault): what megatron and NCCL need on GPU
# when no config was composed (--no-check); with one, ftcore.runtime.gpu_env chooses per GPU
# generation and overlap setting.
GPU_ENV_DEFAULTS = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # megatron's TP/SP communication overlap relies on it
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a failed collective ends the process, not a hang
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "NCCL_DEBUG": "WARN",
}
COMMON_ENV_DEFAULTS = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}

# A worker is not a SLURM task: these would describe the launcher's task, not the worker's rank.
TASK_VARS = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS_PER_NODE",
)


def worker_env(
    layout: Layout, local_rank: int, base: dict[str, str], gpu: bool, cfg=None
) -> dict[str, str]:
    """The torchrun-style environment of one worker (what ftcore.runtime reads); on GPU with the
    job's config, the variables of ftcore.runtime.gpu_env."""
    env = {k: v for k, v in base.items() if k not in TASK_VARS}
    gpu_defaults = GPU_ENV_DEFAULTS if gpu and cfg is None else {}
    for k, v in {**COMMON_ENV_DEFAULTS, **gpu_defaults}.items():
        env.setdefault(k, v)
    if gpu and cfg is not None:
        from ftcore.runtime import gpu_env

        gpu_env.apply(env, cfg, layout.nnodes)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus_available() // layout.nproc_per_node)))
    env.update(
        RANK=str(layout.node_rank * layout.nproc_per_node + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(layout.world_size),
        LOCAL_WORLD_SIZE=str(layout.nproc_per_node),
        GROUP_RANK=str(layout.node_rank),
        NODE_RANK=str(layout.node_rank),
        MASTER_ADDR=layout.master_addr,
        MASTER_PORT=str(layout.master_port),
    )
    return env
