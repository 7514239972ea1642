"""The `k8s` section: what `python -m ftcore.launch.k8s` needs to write a Kubeflow manifest that a
real cluster runs (docs/kubernetes.md says what each key is for). Schema only: the manifest itself
is built in launch/k8s_manifest.py; training never reads this section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class K8sConfig:
    kind: str = "trainjob"  # trainjob | pytorchjob | runtime (the TrainingRuntime a TrainJob names)
    image: Optional[str] = None  # the container image with ftcore installed (required)
    name: Optional[str] = None  # default ftcore-<exp> (a DNS label)
    namespace: Optional[str] = None
    nodes: Optional[int] = None  # default: the experiment's GPUs / cluster.gpus_per_node
    procs_per_node: Optional[int] = None  # default cluster.gpus_per_node (GPU) or launcher's (CPU)
    python: str = "python"  # the interpreter on the image's PATH
    runtime: str = "ftcore-torch"  # the TrainingRuntime the TrainJob runs on (k8s.kind=runtime)
    runtime_kind: str = "TrainingRuntime"  # or ClusterTrainingRuntime (e.g. torch-distributed)
    max_restarts: int = 10  # restarts after exit 3, a node failure or a crash; exit 2 never
    grace_seconds: int = 900  # terminationGracePeriodSeconds: time to save after SIGTERM
    shm_size: str = "64Gi"  # /dev/shm, a memory-backed emptyDir (the 64 MiB default breaks NCCL)
    # per pod (node) requests, Kubernetes quantities; default from the layout (docs/kubernetes.md)
    cpu: Optional[str] = None  # GPU: 8 per process; CPU clusters: the ranks' threads
    memory: Optional[str] = None  # GPU: 16Gi per process + the planner's host peak; CPU: 4Gi
    # shared storage: PersistentVolumeClaims mounted at these paths; run.dir lives on output
    # (ReadWriteMany for multi-node jobs); model and data are mounted read-only (ReadOnlyMany)
    output_claim: Optional[str] = None
    output_path: str = "/outputs"
    model_claim: Optional[str] = None
    model_path: str = "/models"
    data_claim: Optional[str] = None
    data_path: str = "/data"
    fabric: str = "none"  # none | infiniband | efa | gcp: NICs, their resources and NCCL env
    fabric_devices: Optional[int] = None  # RDMA devices per node (efa: 32, a p5.48xlarge's)
    queue: Optional[str] = None  # Kueue LocalQueue: the kueue.x-k8s.io/queue-name label
    service_account: Optional[str] = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[Any] = field(default_factory=list)  # Kubernetes Toleration objects
    env: dict[str, str] = field(default_factory=dict)  # extra variables for the trainer container
    pod_annotations: dict[str, str] = field(default_factory=dict)  # e.g. multi-network (gcp)
