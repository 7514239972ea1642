"""slurm/tiny_cpu.sh against a real SLURM with two nodes: a gloo rendezvous across them, the
preemption path (USR1 -> stop file -> save -> exit 3 -> requeue -> resume), and no requeue after
a user error or past the retry bound. Few jobs, tiny settings: each costs tens of seconds here."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

TINY = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "data.seq_len=64",
    "eval.interval=0",
    "launcher.threads_per_rank=1",  # two "nodes" share this machine's cores
    "checkpoint.interval=0",  # the only mid-run checkpoint is the one a stop request makes
]


def metric_steps(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [r["step"] for r in lines if "loss" in r]


def test_two_nodes_usr1_saves_requeues_resumes_and_finishes(jobs):
    """`sbatch --nodes=2 slurm/tiny_cpu.sh`: a gloo rendezvous across the two nodes; USR1 to the
    batch shell mid-run -> stop file -> checkpoint -> exit 3 -> requeue (same job id) -> resume ->
    exit 0 with every planned step exactly once. (One job covers both, to spend one startup less.)"""
    # enough steps that the run cannot finish before USR1 lands: it travels slurmctld -> slurmd ->
    # the batch shell's trap -> the stop file (~1.5 s seen), while a tiny step takes 0.1-0.25 s
    # (12 steps finished before it once, on a fast run)
    steps = 40
    job = jobs.submit("tiny_cpu.sh", *TINY, f"train.max_steps={steps}")
    run_dir = jobs.run_dir("tiny_full", job)
    deadline = time.monotonic() + 600
    while len(metric_steps(run_dir)) < 3:  # mid-run: a few steps done, most to go
        assert time.monotonic() < deadline, jobs.log(job)
        assert jobs.info(job)["JobState"] in ("PENDING", "RUNNING"), jobs.log(job)
        time.sleep(0.2)
    jobs.cluster.cmd("scancel", "--signal=USR1", "--batch", str(job))
    info = jobs.wait(job, timeout=600)
    log = jobs.log(job)
    state = (info["JobState"], info["ExitCode"], info["Restarts"])
    assert state == ("COMPLETED", "0:0", "1"), jobs.report(job)
    # the rendezvous: two nodes, one worker each, master at the first node's NodeAddr
    assert "nnodes=2 nproc_per_node=1 world_size=2" in log
    assert "rendezvous at 127.0.0.1 nodes=node1,node2" in log
    assert not re.search(r"127\.0\.0\.1:\d", log), "the rendezvous port is in the log"
    assert "node 0: workers done, exit 3" in log and "node 1: workers done, exit 3" in log
    assert "node 0: workers done, exit 0" in log and "node 1: workers done, exit 0" in log
    # the preemption path
    assert "got SIGUSR1" in log and "step exited 3" in log and f"requeueing job {job}" in log
    assert "(restart 1)" in log and "step exited 0: done" in log
    stopped = int(re.search(r"stopped at step (\d+)", log).group(1))
    assert 3 <= stopped < steps, log
    assert metric_steps(run_dir) == list(range(1, steps + 1)), "every step exactly once"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps}"
    assert not (run_dir / "STOP").exists(), "a stop request is consumed by the attempt it stopped"
    assert f"requeueing job {job}" in (run_dir / "logs" / "job.log").read_text()


def test_user_error_is_not_requeued(jobs):
    """Exit 2 is final. The job's files are its user's alone (issue 51 item 9): the run directory
    it made 0700, logs/job.log and the SLURM output file 0600."""
    job = jobs.submit("tiny_cpu.sh", "train.max_steps=not_a_number")
    info = jobs.wait(job, timeout=300)
    log = jobs.log(job)
    state = (info["JobState"], info["ExitCode"], info["Restarts"])
    assert state == ("FAILED", "2:0", "0"), jobs.report(job)
    assert "train.max_steps" in log and "step exited 2: not requeueing" in log
    run_dir = jobs.run_dir("tiny_full", job)
    (out,) = jobs.workdir.glob(f"slurm-*-{job}.out")
    files = (run_dir, run_dir / "logs", run_dir / "logs" / "job.log", out)
    assert [oct(f.stat().st_mode & 0o777) for f in files] == ["0o700", "0o700", "0o600", "0o600"]


def test_a_run_dir_someone_else_made_is_refused_before_any_write(jobs, tmp_path):
    """issue 51 item 4, replayed on a real SLURM: another user (nobody) made the job's run
    directory first, its logs/job.log and STOP linked to files of the victim's. The job fails
    with exit 2 (not requeued) naming run.dir; the victim's files keep their bytes and nothing is
    added to the directory (the batch shell appended to the log before the trainer refused)."""
    import os
    import pwd

    victim_log, victim_stop = tmp_path / "victim.log", tmp_path / "victim.stop"
    victim_log.write_text("the victim's log\n")
    victim_stop.write_text("the victim's file\n")
    run = tmp_path / "planted"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "job.log").symlink_to(victim_log)
    (run / "STOP").symlink_to(victim_stop)
    for d in (run, run / "logs"):
        os.chown(d, pwd.getpwnam("nobody").pw_uid, -1)
        os.chmod(d, 0o777)
    before = sorted(p.name for p in run.rglob("*"))
    job = jobs.submit("tiny_cpu.sh", nodes=2, FTCORE_RUN_DIR=str(run))
    info = jobs.wait(job, timeout=300)
    assert victim_log.read_text() == "the victim's log\n"
    assert victim_stop.read_text() == "the victim's file\n"
    assert sorted(p.name for p in run.rglob("*")) == before
    state = (info["JobState"], info["ExitCode"], info["Restarts"])
    assert state == ("FAILED", "2:0", "0"), jobs.report(job)
    assert f"ftcore error: run.dir: {run} belongs to another user" in jobs.log(job)


def test_requeues_are_bounded(jobs, tmp_path):
    """A worker that always says "requeue me" (3) is requeued FTCORE_MAX_REQUEUES times, no more.
    (A stand-in module: this checks the batch script's bound, not the trainer.)"""
    (tmp_path / "always_stop.py").write_text("import sys\nsys.exit(3)\n")
    env = {"FTCORE_MODULE": "always_stop", "PYTHONPATH": str(tmp_path), "FTCORE_MAX_REQUEUES": "1"}
    job = jobs.submit("tiny_cpu.sh", nodes=1, **env)
    info = jobs.wait(job, timeout=300)
    log = jobs.log(job)
    state = (info["JobState"], info["ExitCode"], info["Restarts"])
    assert state == ("FAILED", "3:0", "1"), jobs.report(job)
    assert log.count("requeueing job") == 1 and "not requeueing" in log


def test_slurm_is_real(slurm_cluster):
    out = slurm_cluster.cmd("sinfo", "-h", "-N", "-o", "%N %t")
    assert out.split() == ["node1", "idle", "node2", "idle"] or "node2" in out
    assert (
        subprocess.run(["scontrol", "ping"], env=slurm_cluster.env, capture_output=True).returncode
        == 0
    )


RECORD = """import json, os, sys
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
with open(os.path.join(args["run.dir"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"argv": sys.argv[1:], "world": os.environ["WORLD_SIZE"],
               "node": os.environ["SLURMD_NODENAME"]}, f)
"""


def test_hydra_submitit_sweep_runs_each_point_as_a_two_node_job(jobs, tmp_path):
    """`-m` sweeps through hydra-submitit-launcher: one SLURM job per point, the per-node launcher
    on every node. (A stand-in module records what each rank was given; the trainer itself runs
    under the same launcher in the tests above.)"""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    (tmp_path / "record_rank.py").write_text(RECORD)
    env = {**jobs.env, "FTCORE_MODULE": "record_rank", "PYTHONPATH": str(tmp_path)}
    cmd = [
        *("python", "-m", "ftcore.launch.sweep", "-m", "hydra/launcher=submitit_slurm"),
        *("hydra.launcher.nodes=2", "hydra.launcher.timeout_min=10", "hydra.sweep.dir=sweep"),
        *("+exp=tiny_full", "train.max_steps=1,2"),
    ]
    r = subprocess.run(cmd, cwd=jobs.workdir, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for point, steps in ((0, "1"), (1, "2")):
        ranks = [
            json.loads((jobs.workdir / "sweep" / str(point) / f"rank{i}.json").read_text())
            for i in (0, 1)
        ]
        assert [rk["node"] for rk in ranks] == ["node1", "node2"] and ranks[0]["world"] == "2"
        assert f"train.max_steps={steps}" in ranks[0]["argv"]
        assert f"run.dir={jobs.workdir}/sweep/{point}" in ranks[1]["argv"]
