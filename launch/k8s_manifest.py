"""The Kubernetes objects of one experiment, as plain dicts: a Kubeflow Trainer `TrainJob`
(trainer.kubeflow.org/v1alpha1), the `TrainingRuntime` it runs on (which holds the restart
policy: a TrainJob has no field for one), or a v1 `PyTorchJob` (kubeflow.org/v1).

Every pod runs ftcore's per-node launcher (`python -m ftcore.launch.node`), which reads the PET_*
variables Kubeflow sets and starts one ftcore.train worker per GPU: unlike torchrun it forwards
SIGTERM to the workers and passes their exit 3 (saved, restart me) on as the pod's status.
Checked against the Kubeflow packages' own models in tests/unit/launch/test_k8s.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

TRAINER_API = "trainer.kubeflow.org/v1alpha1"
NODE = "node"  # the replicated job and container the torch runtime's plugin looks for
PYTORCH_PORT = 23456  # the PyTorchJob operator's default port (container port "pytorchjob-port")
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

# Fabric presets: the NCCL environment, the device resources and the mounts each provider's
# documentation gives for GPUDirect RDMA in pods (docs/kubernetes.md names the sources).
FABRICS = {
    "none": {"env": {}, "resource": None, "devices": 0, "ipc_lock": False, "host_mounts": {}},
    "infiniband": {  # NVIDIA Network Operator's shared RDMA device plugin
        "env": {"NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "eth0"},
        "resource": "rdma/rdma_shared_device_a",
        "devices": 1,
        "ipc_lock": True,
        "host_mounts": {},
    },
    "efa": {  # AWS EFA device plugin on EKS (p4d: 4 devices, p5: 32)
        "env": {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"},
        "resource": "vpc.amazonaws.com/efa",
        "devices": 32,
        "ipc_lock": True,
        "host_mounts": {},
    },
    "gcp": {  # GKE A3 Ultra / A4: the gIB NCCL plugin the node installs
        "env": {
            "NCCL_NET": "gIB",
            "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64:/usr/local/gib/lib64",
        },
        "resource": None,
        "devices": 0,
        "ipc_lock": False,
        "host_mounts": {"gib": ("/home/kubernetes/bin/gib", "/usr/local/gib")},
    },
}


@dataclass
class Job:
    """What every kind of manifest is built from (launch/k8s.py fills it from the config)."""

    name: str
    image: str
    argv: list[str]  # python -m ftcore.launch.node ... -- overrides
    nodes: int
    procs_per_node: int
    gpus_per_node: int  # 0 on a CPU cluster
    env: dict[str, str]
    k8s: object  # the composed k8s section
    labels: dict[str, str] = field(default_factory=dict)
    cpu: str = "1"  # requests per pod (node): Kubernetes quantities (launch/k8s.py sizes them)
    memory: str = "4Gi"


def _metadata(job: Job, name: str | None = None) -> dict:
    meta: dict = {"name": name or job.name}
    if job.k8s.namespace:
        meta["namespace"] = job.k8s.namespace
    labels = dict(job.labels)
    if job.k8s.queue:
        labels[QUEUE_LABEL] = job.k8s.queue
    if labels:
        meta["labels"] = labels
    return meta


def _env(job: Job) -> list[dict]:
    return [{"name": k, "value": str(v)} for k, v in job.env.items()]


def _resources(job: Job) -> dict:
    """GPUs and RDMA devices as limits (= requests, as extended resources must be); CPU and memory
    as requests, so the scheduler places a pod where they are (no limit: a training process
    throttled or OOM-killed by a guess would be worse than one that uses what the node has)."""
    limits: dict = {}
    if job.gpus_per_node:
        limits["nvidia.com/gpu"] = str(job.gpus_per_node)  # a quantity: a string in the API
    fabric = FABRICS[job.k8s.fabric]
    if fabric["resource"]:
        limits[fabric["resource"]] = str(job.k8s.fabric_devices or fabric["devices"])
    requests = {"cpu": job.cpu, "memory": job.memory, **limits}
    return {"limits": limits, "requests": requests} if limits else {"requests": requests}


def _volumes(job: Job) -> tuple[list[dict], list[dict]]:
    """The pod's volumes and the trainer container's mounts: /dev/shm in memory, the claims. Models
    and data are only read: mounted read-only (a multi-node job needs them ReadOnlyMany, or
    ReadWriteMany; the outputs ReadWriteMany: every node writes its checkpoint shards there)."""
    k = job.k8s
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    for name, claim, path, read_only in (
        ("outputs", k.output_claim, k.output_path, False),
        ("models", k.model_claim, k.model_path, True),
        ("data", k.data_claim, k.data_path, True),
    ):
        if claim:
            pvc = {"claimName": claim, **({"readOnly": True} if read_only else {})}
            volumes.append({"name": name, "persistentVolumeClaim": pvc})
            mounts.append(
                {"name": name, "mountPath": path, **({"readOnly": True} if read_only else {})}
            )
    for name, (host, path) in FABRICS[k.fabric]["host_mounts"].items():
        volumes.append({"name": name, "hostPath": {"path": host}})
        mounts.append({"name": name, "mountPath": path})
    return volumes, mounts


def _pod_spec(job: Job, volumes: list[dict]) -> dict:
    k = job.k8s
    spec: dict = {"volumes": volumes, "terminationGracePeriodSeconds": k.grace_seconds}
    if k.node_selector:
        spec["nodeSelector"] = dict(k.node_selector)
    if k.tolerations:
        spec["tolerations"] = [dict(t) for t in k.tolerations]
    if k.service_account:
        spec["serviceAccountName"] = k.service_account
    return spec


def _security(job: Job) -> dict:
    return {"capabilities": {"add": ["IPC_LOCK"]}} if FABRICS[job.k8s.fabric]["ipc_lock"] else {}


def _pod_template(job: Job, volumes: list, container: dict) -> dict:
    """One node's pod: the container (with the job's security context), volumes, scheduling and
    annotations; the TrainJob's runtime patch and the PyTorchJob's replicas share it."""
    if _security(job):
        container["securityContext"] = _security(job)
    pod = _pod_spec(job, volumes)
    pod["containers"] = [container]
    template: dict = {"spec": pod}
    if job.k8s.pod_annotations:
        template["metadata"] = {"annotations": dict(job.k8s.pod_annotations)}
    return template


def train_job(job: Job) -> dict:
    """The TrainJob: trainer (image, argv, env, nodes, processes and GPUs per node) plus a
    runtime patch for what the trainer fields cannot say (volumes, scheduling, grace)."""
    volumes, mounts = _volumes(job)
    container = {"name": NODE, "volumeMounts": mounts}
    template = _pod_template(job, volumes, container)
    trainer = {
        "image": job.image,
        "command": job.argv[:3],
        "args": job.argv[3:],
        "env": _env(job),
        "numNodes": job.nodes,
        "numProcPerNode": job.procs_per_node,
    }
    if _resources(job):
        trainer["resourcesPerNode"] = _resources(job)
    replicated = {"name": NODE, "template": {"spec": {"template": template}}}
    return {
        "apiVersion": TRAINER_API,
        "kind": "TrainJob",
        "metadata": _metadata(job),
        "spec": {
            "runtimeRef": {
                "apiGroup": "trainer.kubeflow.org",
                "kind": job.k8s.runtime_kind,
                "name": job.k8s.runtime,
            },
            "trainer": trainer,
            "runtimePatches": [
                {
                    "manager": "ftcore",
                    "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [replicated]}}},
                }
            ],
        },
    }


def training_runtime(job: Job) -> dict:
    """The runtime the TrainJob names, holding the restart policy: a pod that exits 2 (a user
    error) fails the job at once; any other failure (exit 3 after saving, a lost node, a crash)
    restarts every pod, up to k8s.max_restarts times, and they resume from checkpoints/latest."""
    k = job.k8s
    user_error = {"action": "FailJob", "onExitCodes": {"containerName": NODE, "operator": "In", "values": [2]}}  # fmt: skip
    pod = {"restartPolicy": "Never", "containers": [{"name": NODE, "image": job.image}]}
    meta = {"name": k.runtime, "labels": {"trainer.kubeflow.org/framework": "torch"}}
    if k.namespace and k.runtime_kind == "TrainingRuntime":
        meta["namespace"] = k.namespace
    return {
        "apiVersion": TRAINER_API,
        "kind": k.runtime_kind,
        "metadata": meta,
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {
                "spec": {
                    "failurePolicy": {
                        "maxRestarts": k.max_restarts,
                        "rules": [
                            {
                                "name": "userError",
                                "action": "FailJobSet",
                                "onJobFailureReasons": ["PodFailurePolicy"],
                            }
                        ],
                    },
                    "replicatedJobs": [
                        {
                            "name": NODE,
                            "template": {
                                "metadata": {
                                    "labels": {
                                        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"
                                    }
                                },
                                "spec": {
                                    "backoffLimit": 0,
                                    "podFailurePolicy": {"rules": [user_error]},
                                    "template": {"spec": pod},
                                },
                            },
                        }
                    ],
                }
            },
        },
    }


def pytorch_job(job: Job) -> dict:
    """The v1 PyTorchJob: a Master and nodes-1 Workers, each restarted in place on failure
    (restartPolicy OnFailure: the operator's ExitCode policy would treat exit 3 as permanent),
    up to k8s.max_restarts (runPolicy.backoffLimit)."""
    volumes, mounts = _volumes(job)
    container: dict = {
        "name": "pytorch",
        "image": job.image,
        "command": job.argv[:3],
        "args": job.argv[3:],
        "env": _env(job),
        "ports": [{"name": "pytorchjob-port", "containerPort": PYTORCH_PORT}],
        "volumeMounts": mounts,
    }
    if _resources(job):
        container["resources"] = _resources(job)
    template = _pod_template(job, volumes, container)
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if job.nodes > 1:
        replicas["Worker"] = {
            "replicas": job.nodes - 1,
            "restartPolicy": "OnFailure",
            "template": copy.deepcopy(template),
        }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(job),
        "spec": {
            "nprocPerNode": str(job.procs_per_node),
            "runPolicy": {"backoffLimit": job.k8s.max_restarts},
            "pytorchReplicaSpecs": replicas,
        },
    }


BUILDERS = {"trainjob": train_job, "runtime": training_runtime, "pytorchjob": pytorch_job}
