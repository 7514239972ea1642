"""ftcore.launch.k8s's manifests against the Kubeflow APIs' own models (kubeflow-trainer-api for
TrainJob and TrainingRuntime, kubeflow-training for the v1 PyTorchJob): every key written is one
the model knows (its round trip drops none), the layout is the experiment's, /dev/shm is in
memory, and a job that does not fit is refused before any YAML. The pods' command run for real:
tests/multiproc/test_k8s_pods.py."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from ftcore.launch import k8s, pet_env

from ftcore.config.schema import compose
from tests.support.cli import ROOT

GPU_EXPS = ("70b_fp8", "405b_lora", "qwen25_72b_lora")
CLAIMS = ["k8s.output_claim=runs", "k8s.model_claim=models", "k8s.data_claim=data"]


def emit(capsys, *overrides) -> dict:
    assert k8s.main(["k8s.image=registry.example/ftcore:1", *overrides]) == 0, (
        capsys.readouterr().err
    )
    return yaml.safe_load(capsys.readouterr().out)


def dropped(sent, back, path="") -> list[str]:
    """Keys (or values) of `sent` that did not come back from the model, as paths."""
    if isinstance(sent, dict):
        if not isinstance(back, dict):
            return [path or "/"]
        out = []
        for key, value in sent.items():
            if key not in back:
                out.append(f"{path}/{key}")
            else:
                out += dropped(value, back[key], f"{path}/{key}")
        return out
    if isinstance(sent, list):
        if not isinstance(back, list) or len(back) != len(sent):
            return [path]
        return [
            p for i, (s, b) in enumerate(zip(sent, back)) for p in dropped(s, b, f"{path}[{i}]")
        ]
    return [] if sent == back else [f"{path}={sent!r}->{back!r}"]


def trainer_round_trip(doc: dict) -> dict:
    from kubeflow_trainer_api import models

    model = {
        "TrainJob": models.TrainerV1alpha1TrainJob,
        "TrainingRuntime": models.TrainerV1alpha1TrainingRuntime,
        "ClusterTrainingRuntime": models.TrainerV1alpha1ClusterTrainingRuntime,
    }[doc["kind"]]
    return model.from_dict(doc).to_dict()


def pytorchjob_round_trip(doc: dict) -> dict:
    from kubeflow.training import ApiClient

    api = ApiClient()
    job = api.deserialize(SimpleNamespace(data=json.dumps(doc)), "KubeflowOrgV1PyTorchJob")
    return api.sanitize_for_serialization(job)


def misspelt(doc: dict, path: list, good: str, bad: str) -> dict:
    """A copy of doc with one key renamed, `path` leading to the dict that holds it."""
    doc = copy.deepcopy(doc)
    holder = doc
    for step in path:
        holder = holder[step]
    holder[bad] = holder.pop(good)
    return doc


def stamp_of(after: list[str]) -> str:
    """The submission's suffix of run.dir (UTC time and 4 hex digits), also in run.id."""
    (run_dir,) = [a for a in after if a.startswith("run.dir=")]
    stamp = re.search(r"-(\d{8}-\d{6}-[0-9a-f]{4})$", run_dir)
    assert stamp, run_dir
    (run_id,) = [a for a in after if a.startswith("run.id=")]
    assert run_id.endswith(stamp.group(1)), (run_dir, run_id)
    return stamp.group(1)


def argv_of(trainer: dict) -> list[str]:
    argv = [*trainer["command"], *trainer["args"]]
    assert argv[0] in ("python", "python3", "torchrun"), argv
    assert not any("$(" in a or a in ("sh", "bash", "-c") for a in argv), argv
    return argv


@pytest.mark.parametrize("exp", GPU_EXPS)
def test_trainjob_of_each_gpu_experiment(capsys, exp):
    over = [f"+exp={exp}", "model.allow_random_base=true", "train.max_steps=7", *CLAIMS]
    doc = emit(capsys, *over)
    assert dropped(doc, trainer_round_trip(doc)) == []
    t = doc["spec"]["trainer"]
    gpus = int(t["resourcesPerNode"]["limits"]["nvidia.com/gpu"])
    assert t["numNodes"] * gpus == compose([f"+exp={exp}"]).cluster.num_gpus
    assert t["numProcPerNode"] == gpus
    argv = argv_of(t)
    assert argv[:3] == ["python", "-m", "ftcore.launch.node"] and "--module=ftcore.train" in argv
    after = argv[argv.index("--") + 1 :]
    name = f"ftcore-{exp.replace('_', '-')}"
    assert after[0] == f"+exp={exp}" and f"run.dir=/outputs/{exp}/{name}-{stamp_of(after)}" in after
    assert "train.max_steps=7" in after and not any(a.startswith("k8s.") for a in after)
    env = {e["name"]: e["value"] for e in t["env"]}
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "CUDA_DEVICE_MAX_CONNECTIONS" in env
    pod = doc["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    pod = pod["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {
        m["mountPath"]: m.get("readOnly", False) for m in pod["containers"][0]["volumeMounts"]
    }
    # issue 52 item 11: models and data only read (mount and claim), outputs written
    assert mounts == {"/dev/shm": False, "/outputs": False, "/models": True, "/data": True}
    assert [volumes[v]["persistentVolumeClaim"].get("readOnly", False)
            for v in ("outputs", "models", "data")] == [False, True, True]  # fmt: skip
    assert pod["terminationGracePeriodSeconds"] >= 600
    # CPU and memory requested beside the GPUs: 8 CPUs and >= 16 GiB per GPU
    requests = t["resourcesPerNode"]["requests"]
    assert int(requests["cpu"]) == 8 * gpus and requests["memory"].endswith("Gi")
    assert int(requests["memory"][:-2]) >= 16 * gpus


def test_misspelt_keys_are_caught(capsys):
    """The round trip is a check only if a key the model does not know shows up as dropped."""
    doc = emit(capsys, "+exp=70b_fp8", "model.allow_random_base=true", "k8s.queue=team-a")
    assert doc["metadata"]["labels"][k8s.k8s_manifest.QUEUE_LABEL] == "team-a"
    assert dropped(doc, trainer_round_trip(doc)) == []
    bad = misspelt(doc, ["spec", "trainer"], "numNodes", "numNode")
    assert dropped(bad, trainer_round_trip(bad)) == ["/spec/trainer/numNode"]
    patch = ["spec", "runtimePatches", 0, "trainingRuntimeSpec", "template", "spec", "replicatedJobs",
             0, "template", "spec", "template", "spec", "volumes", 0, "emptyDir"]  # fmt: skip
    bad = misspelt(doc, patch, "medium", "medim")
    assert dropped(bad, trainer_round_trip(bad)) == [
        "/spec/runtimePatches[0]/trainingRuntimeSpec/template/spec/replicatedJobs[0]/template/spec/"
        "template/spec/volumes[0]/emptyDir/medim"
    ]


def test_pytorchjob_and_runtime(capsys):
    over = ["+exp=405b_full", "model.allow_random_base=true", "k8s.fabric=efa", *CLAIMS]
    doc = emit(capsys, *over, "k8s.kind=pytorchjob", "k8s.max_restarts=4")
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
    assert dropped(doc, pytorchjob_round_trip(doc)) == []
    bad = misspelt(
        doc, ["spec", "pytorchReplicaSpecs", "Master"], "restartPolicy", "restartPolicyy"
    )
    assert dropped(bad, pytorchjob_round_trip(bad)) == [
        "/spec/pytorchReplicaSpecs/Master/restartPolicyy"
    ]
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    c = replicas["Worker"]["template"]["spec"]["containers"][0]
    nodes = 1 + replicas["Worker"]["replicas"]
    assert nodes * int(c["resources"]["limits"]["nvidia.com/gpu"]) == 128
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32"
    assert doc["spec"]["nprocPerNode"] == "8" and doc["spec"]["runPolicy"]["backoffLimit"] == 4
    assert replicas["Master"]["restartPolicy"] == "OnFailure"
    argv_of(c)
    assert c["resources"]["requests"]["cpu"] == "64"  # 8 per GPU, beside the GPUs and the NICs
    assert {m["mountPath"]: m.get("readOnly", False) for m in c["volumeMounts"]}["/models"]
    rt = emit(capsys, *over, "k8s.kind=runtime", "k8s.max_restarts=4")
    assert dropped(rt, trainer_round_trip(rt)) == []
    js = rt["spec"]["template"]["spec"]
    assert js["failurePolicy"]["maxRestarts"] == 4
    rule = js["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2]


def test_a_job_that_does_not_fit_prints_no_yaml():
    r = subprocess.run(
        [sys.executable, "-m", "ftcore.launch.k8s", "+exp=405b_lora", "cluster=h100",
         "model.allow_random_base=true"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("ftcore error:")]
    assert any("out of memory" in e and "GiB" in e for e in errors), r.stderr[-2000:]
    assert any(e.startswith("ftcore error: k8s.image:") for e in errors)


def test_pet_layout_of_trainjob_and_pytorchjob_pods():
    trainjob = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1",
                "PET_MASTER_ADDR": "j-node-0-0.j", "PET_MASTER_PORT": "29500"}  # fmt: skip
    at = pet_env.from_env(trainjob, pet_env.nproc(trainjob))
    assert (at.nnodes, at.node_rank, at.nproc_per_node, at.world_size) == (2, 1, 8, 16)
    assert (at.master_addr, at.master_port) == ("j-node-0-0.j", 29500)
    v1 = {
        "PET_NNODES": "3",
        "PET_NODE_RANK": "2",
        "MASTER_ADDR": "j-master-0",
        "MASTER_PORT": "23456",
    }
    at = pet_env.from_env(v1, 4)
    assert (at.master_addr, at.master_port, at.node_rank) == ("j-master-0", 23456, 2)
    with pytest.raises(Exception, match="PET_NNODES"):
        pet_env.from_env({"PET_NNODES": "1:4"}, 1)


def test_the_docs_first_command_prints_the_runtime(capsys):
    """issue 52 item 4: docs/kubernetes.md's first command, as written there (without the pipe to
    kubectl), prints the TrainingRuntime: it holds the restart policy and names no model or data,
    so it asks for none (it exited 2 asking for base weights)."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    first = next(ln for ln in text.splitlines() if ln.startswith("python -m ftcore.launch.k8s"))
    argv = shlex.split(first.split("|")[0])
    assert argv[:3] == ["python", "-m", "ftcore.launch.k8s"] and "k8s.kind=runtime" in argv, argv
    assert k8s.main(argv[3:]) == 0, capsys.readouterr().err
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["kind"] == "TrainingRuntime" and dropped(doc, trainer_round_trip(doc)) == []


def test_a_multi_node_job_without_an_output_volume_is_refused(capsys):
    """issue 52 item 11: without k8s.output_claim a 2-node job would write its checkpoints to each
    pod's own disk: exit 2 with the fix, and no YAML (it was printed, with a warning). One node
    without it: a warning, and the job (test_misspelt_keys_are_caught)."""
    status = k8s.main(["k8s.image=r/f:1", "+exp=tiny_lora", "k8s.nodes=2", "k8s.procs_per_node=1"])
    out, err = capsys.readouterr()
    assert status == 2 and out == "", err
    line = next(ln for ln in err.splitlines() if "k8s.output_claim" in ln)
    assert (
        line.startswith("ftcore error: k8s.output_claim: a 2-node job") and "ReadWriteMany" in line
    )


def test_each_submission_gets_its_own_run_dir_unless_pinned(capsys):
    """issue 52 item 2 (Kubernetes): each manifest is one submission, with a run directory and run
    id of its own (a resubmission with new data starts its own run; restarts of one job's pods
    share its argv, so they resume it); a run.dir the user gives is kept, with no id added."""
    over = ["+exp=70b_fp8", "model.allow_random_base=true", *CLAIMS]
    first = argv_of(emit(capsys, *over)["spec"]["trainer"])
    again = argv_of(k8s.manifest(compose(over), over)["spec"]["trainer"])  # the next submission
    assert stamp_of(first[first.index("--") + 1 :]) != stamp_of(again[again.index("--") + 1 :])
    cfg = compose([*over, "run.dir=/outputs/mine"])
    pinned = k8s.trainer_argv(cfg, [*over, "run.dir=/outputs/mine"], "ftcore-70b-fp8", "x")
    assert "run.dir=/outputs/mine" in pinned and not any(a.startswith("run.id=") for a in pinned)


def test_requests_are_settings_and_checked(capsys):
    doc = emit(capsys, "+exp=70b_fp8", "model.allow_random_base=true", "k8s.cpu=96",
               "k8s.memory=1500Gi")  # fmt: skip
    assert doc["spec"]["trainer"]["resourcesPerNode"]["requests"]["memory"] == "1500Gi"
    assert doc["spec"]["trainer"]["resourcesPerNode"]["requests"]["cpu"] == "96"
    assert k8s.main(["k8s.image=r/f:1", "+exp=70b_fp8", "k8s.memory=lots"]) == 2
    assert (
        "ftcore error: k8s.memory: 'lots' is not a Kubernetes quantity" in capsys.readouterr().err
    )
