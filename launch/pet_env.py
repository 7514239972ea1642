"""Rendezvous settings from the `PET_*` variables Kubeflow gives each pod, for one launcher per pod.

Kubeflow Trainer's torch plugin sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the pod's
Job completion index), PET_MASTER_ADDR and PET_MASTER_PORT; the v1 PyTorchJob sets PET_NNODES,
PET_NODE_RANK, PET_NPROC_PER_NODE and MASTER_ADDR/MASTER_PORT instead of the PET_MASTER_* pair.
torchrun reads each PET_<FLAG> as the default of its --<flag> (torch.distributed.argparse_util);
ftcore's own launcher reads them the same way, so that a pod told to stop saves and exits 3.
"""

from __future__ import annotations

from ftcore.launch.slurm_env import Layout

from ftcore.errors import FtcoreError

KUBEFLOW_PORT = 29500  # the Trainer's ContainerTrainerPort, when nothing names one


def present(env: dict[str, str]) -> bool:
    """Whether this process runs in a Kubeflow pod (or a test standing in for one)."""
    return "PET_NNODES" in env


def nproc(env: dict[str, str]) -> int | None:
    """PET_NPROC_PER_NODE when it is a number ("auto", "gpu", "cpu": the launcher decides)."""
    value = env.get("PET_NPROC_PER_NODE", "")
    return int(value) if value.isdigit() else None


def from_env(env: dict[str, str], nproc_per_node: int) -> Layout:
    """This pod's place in the job. An elastic range (PET_NNODES=1:4) is refused: ftcore's jobs
    have a fixed world, which its checkpoints and layout checks assume."""
    nnodes = env["PET_NNODES"]
    if not nnodes.isdigit():
        raise FtcoreError(
            f"PET_NNODES={nnodes!r} is not a node count (an elastic range?)",
            field="k8s.nodes",
            fix="a fixed node count: numNodes in the TrainJob, replicas without elasticPolicy",
        )
    addr = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or "127.0.0.1"
    port = env.get("PET_MASTER_PORT") or env.get("MASTER_PORT") or str(KUBEFLOW_PORT)
    return Layout(
        job_id=env.get("FTCORE_JOB_ID", "k8s"),
        nnodes=int(nnodes),
        node_rank=int(env.get("PET_NODE_RANK", "0")),
        nproc_per_node=nproc_per_node,
        master_addr=addr,
        master_port=int(port),
        nodes=[addr],
    )
