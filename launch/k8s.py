"""`python -m ftcore.launch.k8s +exp=NAME k8s.image=IMAGE [overrides]`: one Kubernetes manifest
on stdout (logs on stderr) that runs the experiment on a Kubeflow cluster: a TrainJob (default),
the TrainingRuntime it names (`k8s.kind=runtime`: the restart policy) or a v1 PyTorchJob
(`k8s.kind=pytorchjob`). `kubectl apply -f -` takes it as printed; docs/kubernetes.md.

Before anything is printed, the job passes the SLURM dry run's checks (launch/node.py: layout,
inputs, hardware and memory fit on the target cluster); a job that cannot run exits 2 with one
`ftcore error:` line per problem and prints no YAML. Paths on the cluster's volumes (under a
mount path whose claim is set) cannot be seen from here: the pods check them when they start.
"""

from __future__ import annotations

import copy
import math
import re
import secrets
import sys
import time

from ftcore.launch import k8s_manifest, node, slurm_env

from ftcore.cli import exit_process, quiet_libraries, skip_unused_imports
from ftcore.errors import FtcoreError

KINDS = tuple(k8s_manifest.BUILDERS)
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
MAX_NAME = 40  # the pods are <name>-node-<i>-<j>.<name>: a DNS label of at most 63 characters
PATH_FIELDS = ("data.path", "data.val_path", "model.hf_path", "model.init_path", "model.tokenizer",
               "peft.adapter_path", "checkpoint.resume")  # fmt: skip
# The launcher's own settings: they are not the trainer's, so they stay out of its argv.
OWN = ("k8s.", "+k8s.", "++k8s.")


def job_name(cfg) -> str:
    k = cfg.k8s
    if k.name is not None:
        if len(k.name) > MAX_NAME or not DNS_LABEL.match(k.name):
            raise FtcoreError(
                f"{k.name!r} is not a DNS label of at most {MAX_NAME} characters",
                field="k8s.name",
                fix="lowercase letters, digits and '-', starting with a letter",
            )
        return k.name
    return re.sub(r"[^a-z0-9-]+", "-", f"ftcore-{cfg.run.exp}".lower()).strip("-")[:MAX_NAME]


def settings_problems(cfg) -> list[str]:
    """What is wrong with the k8s section itself, one line each (reported with the job's own)."""
    k, found = cfg.k8s, []
    if not k.image:
        found.append(str(FtcoreError("no container image given", field="k8s.image",
                     fix="k8s.image=REGISTRY/IMAGE:TAG, an image with ftcore installed (Dockerfile)")))  # fmt: skip
    choices = {"k8s.kind": (k.kind, KINDS), "k8s.fabric": (k.fabric, tuple(k8s_manifest.FABRICS)),
               "k8s.runtime_kind": (k.runtime_kind, ("TrainingRuntime", "ClusterTrainingRuntime"))}  # fmt: skip
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            found.append(
                str(
                    FtcoreError(
                        f"{value!r} is not one of {', '.join(allowed)}",
                        field=key,
                        fix=f"{key}={allowed[0]} (or another of those)",
                    )
                )  # fmt: skip
            )
    for key in ("nodes", "procs_per_node", "fabric_devices"):
        if k[key] is not None and k[key] < 1:
            found.append(str(FtcoreError(f"must be >= 1, got {k[key]}", field=f"k8s.{key}",
                                         fix=f"k8s.{key}=1 or more, or leave it unset")))  # fmt: skip
    for key in ("max_restarts", "grace_seconds"):
        if k[key] < 0:
            found.append(str(FtcoreError(f"must be >= 0, got {k[key]}", field=f"k8s.{key}",
                                         fix=f"k8s.{key}=0 or more")))  # fmt: skip
    for key in ("cpu", "memory"):
        if k[key] is not None and not QUANTITY.match(str(k[key])):
            found.append(str(FtcoreError(f"{k[key]!r} is not a Kubernetes quantity", field=f"k8s.{key}",
                                         fix=f"k8s.{key}={'16' if key == 'cpu' else '256Gi'} "
                                         "(a number, with a suffix such as m, Gi or G)")))  # fmt: skip
    reserved = sorted(v for v in k.env if v.startswith("PET_"))
    if reserved:
        found.append(str(FtcoreError(f"{', '.join(reserved)} are Kubeflow's to set", field="k8s.env",
                         fix="set the layout with k8s.nodes and k8s.procs_per_node")))  # fmt: skip
    return found


def storage_problems(cfg, at: slurm_env.Layout) -> list[str]:
    """A job of several nodes needs one run.dir that every pod writes and a restart finds: a
    shared output volume. Without one, each pod's checkpoint shards would stay on its own disk."""
    if at.nnodes == 1 or cfg.k8s.output_claim:
        return []
    return [str(FtcoreError(
        f"a {at.nnodes}-node job without an output volume: run.dir would be on each pod's own "
        "disk, its checkpoints split over the pods and lost when they restart",
        field="k8s.output_claim",
        fix="k8s.output_claim=<a ReadWriteMany PersistentVolumeClaim> (mounted at "
        f"k8s.output_path={cfg.k8s.output_path})"))]  # fmt: skip


def requests(cfg, at: slurm_env.Layout) -> tuple[str, str]:
    """CPU and memory each pod requests: k8s.cpu / k8s.memory, else from the layout. GPU: 8 CPUs
    per process (data loading, the launcher, NCCL's proxy threads; an 8-GPU node has 100-200)
    and 16 GiB per process (CUDA context, NCCL, tokenizer, loader) plus the host memory the
    planner gives a rank (a random base drawn on the host, an async save's staging). CPU
    clusters: each rank's threads, and 4 GiB per rank."""
    c, k, n = cfg.cluster, cfg.k8s, at.nproc_per_node
    if c.device == "cpu":
        threads = cfg.launcher.threads_per_rank or 1
        cpu, memory = str(n * threads), f"{4 * n}Gi"
    else:
        from ftcore.planner.memory import host_bytes

        peak = max(host_bytes(cfg, at.world_size, r)["peak"] for r in range(cfg.parallel.pp))
        cpu, memory = str(8 * n), f"{n * (16 + math.ceil(peak / 2**30))}Gi"
    return str(k.cpu or cpu), str(k.memory or memory)


def layout(cfg) -> slurm_env.Layout:
    """Nodes x processes per node, as the SLURM script allocates: the experiment's GPUs over
    cluster.gpus_per_node (one process per GPU); on a CPU cluster launcher.nproc_per_node."""
    c, k = cfg.cluster, cfg.k8s
    gpu = c.device != "cpu"
    procs = k.procs_per_node or (c.gpus_per_node if gpu else cfg.launcher.nproc_per_node)
    nodes = k.nodes or (max(1, math.ceil(c.num_gpus / procs)) if gpu and c.num_gpus else 1)
    addr = f"{job_name(cfg)}-node-0-0"
    return slurm_env.Layout("k8s", nodes, 0, procs, addr, 29500, [addr])


def on_cluster(cfg) -> list[str]:
    """The mount paths of the claims that are set: what lies under them lives on the cluster."""
    k = cfg.k8s
    pairs = (
        (k.output_claim, k.output_path),
        (k.model_claim, k.model_path),
        (k.data_claim, k.data_path),
    )
    return [path.rstrip("/") + "/" for claim, path in pairs if claim]


def checkable(cfg):
    """A copy of cfg whose paths on the cluster's volumes are left out of the checks (a base on
    the cluster stands in as given: the memory fit uses the model group's shapes)."""
    roots = on_cluster(cfg)
    out = copy.deepcopy(cfg)
    if not roots:
        return out
    fields = [*PATH_FIELDS, *(f"data.mix.{i}.path" for i in range(len(cfg.data.mix)))]
    for key in fields:
        section, _, name = key.rpartition(".")
        holder = out
        for part in section.split("."):
            holder = holder[int(part)] if part.isdigit() else holder[part]
        value = holder[name]
        if isinstance(value, str) and any((value.rstrip("/") + "/").startswith(r) for r in roots):
            holder[name] = None if key != "checkpoint.resume" else "auto"
            if key in ("model.hf_path", "model.init_path"):
                out.model.allow_random_base = True
    return out


def problems(cfg, at: slurm_env.Layout) -> list[str]:
    """The SLURM dry run's checks (launch/node.py), against this layout and the target cluster."""
    checked = checkable(cfg)
    return node.check(at, checked) + node.job_problems(at, checked, "ftcore.train")


def submission() -> str:
    """This submission's own suffix: UTC time to the second and 4 random hex digits."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def trainer_argv(cfg, overrides: list[str], name: str, stamp: str) -> list[str]:
    """python -m ftcore.launch.node ... -- +exp=NAME run.dir=... [the user's overrides].

    Unless the user names run.dir, each submission gets its own (`<name>-<stamp>`) and run.id: a
    restart of this job's pods (same manifest) resumes it, a new submission of the experiment
    (new data, new settings) starts a run of its own instead of continuing the last one."""
    k = cfg.k8s
    mine = [o for o in overrides if not o.startswith(OWN)]
    exp = [o for o in mine if o.lstrip("+").startswith("exp=")]
    rest = [o for o in mine if o not in exp]
    given = {o.lstrip("+~").split("=", 1)[0] for o in rest}
    ours = []
    if "run.dir" not in given:
        ours.append(f"run.dir={default_run_dir(cfg, name, stamp)}")
        if "run.id" not in given:  # resume=auto then refuses a checkpoint of another submission
            ours.append(f"run.id=k8s:{name}-{stamp}")
    if "checkpoint.resume" not in given:
        ours.append("checkpoint.resume=auto")
    # --linger=0: the SLURM linger keeps srun from killing nodes still saving; in a pod the
    # workers have saved (a collective) before any of them exits 3, and the grace period covers
    # the rest of the exit.
    launcher = ["--module=ftcore.train", "--linger=0", "--"]
    return [k.python, "-m", "ftcore.launch.node", *launcher, *exp, *ours, *rest]


def default_run_dir(cfg, name: str, stamp: str) -> str:
    return f"{cfg.k8s.output_path.rstrip('/')}/{cfg.run.exp}/{name}-{stamp}"


def environment(cfg, nodes: int) -> dict[str, str]:
    """What ftcore's SLURM launcher gives a GPU worker (runtime/gpu_env.py), the fabric preset's
    NCCL variables, then k8s.env (which wins)."""
    env = dict(slurm_env.COMMON_ENV_DEFAULTS)
    if cfg.cluster.device != "cpu":
        from ftcore.runtime import gpu_env

        env.update(gpu_env.gpu_env(cfg, nodes))
    env.update(k8s_manifest.FABRICS[cfg.k8s.fabric]["env"])
    env.update({str(key): str(v) for key, v in cfg.k8s.env.items()})
    return env


def manifest(cfg, overrides: list[str], stamp: str = "") -> dict:
    at = layout(cfg)
    name = job_name(cfg)
    gpus = at.nproc_per_node if cfg.cluster.device != "cpu" else 0
    cpu, memory = requests(cfg, at)
    job = k8s_manifest.Job(
        name=name,
        image=cfg.k8s.image,
        argv=trainer_argv(cfg, overrides, name, stamp or submission()),
        cpu=cpu,
        memory=memory,
        nodes=at.nnodes,
        procs_per_node=at.nproc_per_node,
        gpus_per_node=gpus,
        env=environment(cfg, at.nnodes),
        k8s=cfg.k8s,
        labels={"app.kubernetes.io/managed-by": "ftcore", "ftcore/exp": job_name(cfg)[7:] or "exp"},
    )
    return k8s_manifest.BUILDERS[cfg.k8s.kind](job)


def to_yaml(doc: dict) -> str:
    import yaml

    class Plain(yaml.SafeDumper):
        def ignore_aliases(self, data):  # every object written out: kubectl needs no anchors
            return True

    return yaml.dump(doc, Dumper=Plain, sort_keys=False, default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    from ftcore.config.schema import compose
    from ftcore.runtime import megatron_jit

    megatron_jit.install()  # the checks import megatron-core (as ftcore/cli.py does)
    quiet_libraries("--verbose" in (sys.argv if argv is None else argv))
    overrides = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--verbose"]
    stamp = submission()
    try:
        cfg = compose(overrides)
        skip_unused_imports(cfg)
        found = settings_problems(cfg)
        runtime = cfg.k8s.kind == "runtime"  # the restart policy only: no model, data or layout
        bad_layout = any(p.startswith("k8s.") and "image" not in p for p in found)
        if not (bad_layout or runtime):
            found += storage_problems(cfg, layout(cfg)) + problems(cfg, layout(cfg))
        doc = None if found else manifest(cfg, overrides, stamp)
    except FtcoreError as e:
        found = [str(e)]
    for p in found:
        print(f"ftcore error: {p}", file=sys.stderr, flush=True)
    if found:
        return 2
    if not runtime and not cfg.k8s.output_claim:
        print(
            "ftcore.launch.k8s: k8s.output_claim is unset: run.dir is on the pod's own disk, so a "
            "restarted job cannot resume",
            file=sys.stderr,
        )
    if not runtime and "run.dir" not in {o.lstrip("+~").split("=", 1)[0] for o in overrides}:
        print(
            f"ftcore.launch.k8s: run.dir={default_run_dir(cfg, job_name(cfg), stamp)}: this "
            "submission's own (restarts of its pods resume it; pass run.dir=... to pin one)",
            file=sys.stderr,
        )
    sys.stdout.write(to_yaml(doc))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    exit_process(main())
