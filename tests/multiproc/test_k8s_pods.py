"""The manifest's trainer command, run as Kubeflow runs it: `command + args` of the TrainJob that
`python -m ftcore.launch.k8s +exp=tiny_lora k8s.nodes=2 k8s.procs_per_node=1` prints, started as
two local "pods" with the PET_* variables Kubeflow Trainer's torch plugin gives each pod
(PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK = the Job completion index, PET_MASTER_ADDR,
PET_MASTER_PORT) plus the manifest's env. One pod is sent SIGTERM mid-run (a preempted node):
both pods exit 3 after saving; started again, they resume and finish (exit 0), and every step's
numbers equal those of the same run on one node with two processes (the manifest of
k8s.nodes=1 k8s.procs_per_node=2), to the last bit.

The master address stands in for the headless service (127.0.0.1); the test hosts the rendezvous
store on a port the kernel picked and the ranks join it (tests/support/rendezvous.py), where a
pod would bind Kubeflow's fixed port in its own network namespace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.ckpt_cases import last_step, latest, same_metrics
from tests.support.cli import LAUNCHER_ENV, ROOT
from tests.support.rendezvous import ADDR, host_store, rank_env

pytestmark = [pytest.mark.dist, pytest.mark.slow]

RUN = ["+exp=tiny_lora", "train.max_steps=8", "eval.interval=0", "eval.accuracy=false",
       "checkpoint.interval=0", "logger.progress=lines", "k8s.image=local",
       "k8s.output_claim=runs",  # a shared volume, which two nodes need (here: tmp_path)
       "+k8s.env.OMP_NUM_THREADS=1"]  # fmt: skip


def manifest(run_dir: Path, nodes: int, procs: int) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "ftcore.launch.k8s", *RUN, f"k8s.nodes={nodes}",
         f"k8s.procs_per_node={procs}", f"run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return yaml.safe_load(r.stdout)


class Pods:
    """Each node of the TrainJob as one process: the trainer's argv with the pod's environment."""

    def __init__(self, doc: dict, log: Path):
        t = doc["spec"]["trainer"]
        argv = [*t["command"], *t["args"]]
        assert argv[0] == "python"
        argv[0] = sys.executable  # the image's python: this checkout's
        self.store = host_store(t["numNodes"] * t["numProcPerNode"])  # open while the pods live
        base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
        base.update({e["name"]: e["value"] for e in t["env"]}, PYTHONPATH=str(ROOT))
        base["FTCORE_LOG_LEVEL"] = "INFO"
        base.update(rank_env(self.store))  # TORCHELASTIC_USE_AGENT_STORE: join the test's store
        self.log = open(log, "a")  # noqa: SIM115 - closed in wait()
        self.procs = []
        for index in range(t["numNodes"]):
            pet = {
                "PET_NNODES": str(t["numNodes"]),
                "PET_NPROC_PER_NODE": str(t["numProcPerNode"]),
                "PET_NODE_RANK": str(index),
                "PET_MASTER_ADDR": ADDR,
                "PET_MASTER_PORT": str(self.store.port),
            }
            self.procs.append(subprocess.Popen(argv, env={**base, **pet}, cwd=ROOT,
                                               stdout=self.log, stderr=subprocess.STDOUT))  # fmt: skip

    def wait(self, timeout: float = 400) -> list[int]:
        try:
            return [p.wait(timeout=timeout) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
            self.log.close()


def text(log: Path) -> str:
    return log.read_text()[-3000:]


def test_trainjob_pods_train_stop_on_sigterm_and_resume(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    one_node = manifest(ref, nodes=1, procs=2)
    assert Pods(one_node, tmp_path / "ref.log").wait() == [0], text(tmp_path / "ref.log")
    two_nodes = manifest(run, nodes=2, procs=1)
    pods = Pods(two_nodes, tmp_path / "run1.log")
    while last_step(run) < 2:  # then preempt node 1: kubelet's SIGTERM to the pod's command
        assert all(p.poll() is None for p in pods.procs), text(tmp_path / "run1.log")
        time.sleep(0.01)
    pods.procs[1].send_signal(signal.SIGTERM)
    assert pods.wait() == [3, 3], text(tmp_path / "run1.log")
    stopped = last_step(run)
    assert 2 <= stopped < 8 and latest(run) == f"step_{stopped}"
    assert Pods(two_nodes, tmp_path / "run2.log").wait() == [0, 0], text(tmp_path / "run2.log")
    assert "resumed from" in (tmp_path / "run2.log").read_text()
    same_metrics(run, ref)
    assert (run / "hf_adapter" / "adapter_model.safetensors").is_file()
