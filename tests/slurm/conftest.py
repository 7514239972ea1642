"""A real local SLURM for the tests of slurm/*.sh: installed (apt-get) and started once per session,
with two `slurmd -N` nodes on this machine; stopped by the PIDs in its pid files at the end."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import localslurm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def slurm_cluster():
    try:
        localslurm.ensure_installed()
    except localslurm.Unavailable as e:
        pytest.skip(f"no local SLURM: {e}")
    root = Path(
        tempfile.mkdtemp(prefix="ftcore-slurm-")
    )  # not under pytest's 0700 tmp: munge reads it
    try:
        cluster = localslurm.up(root)
    except Exception as e:
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"local SLURM did not start: {e}")
    yield cluster
    localslurm.down(root)
    shutil.rmtree(root, ignore_errors=True)


class Jobs:
    """sbatch from a clean submit directory, with the python on PATH; poll jobs by scontrol."""

    def __init__(self, cluster: localslurm.Cluster, workdir: Path):
        self.cluster = cluster
        self.workdir = workdir
        env = {k: v for k, v in cluster.env.items() if not k.startswith(("FTCORE_", "SLURM_JOB"))}
        env["SLURM_CONF"] = cluster.env["SLURM_CONF"]
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
        env.pop("MASTER_ADDR", None), env.pop("MASTER_PORT", None)
        self.env = env

    def submit(self, script: str, *args: str, nodes: int = 2, **env: str) -> int:
        import subprocess

        cmd = ["sbatch", "--parsable", f"--nodes={nodes}", str(ROOT / "slurm" / script), *args]
        r = subprocess.run(
            cmd, cwd=self.workdir, env={**self.env, **env}, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        return int(r.stdout.strip().split(";")[0])

    def info(self, job: int) -> dict[str, str]:
        return localslurm.job_info(self.cluster, job)

    def wait(self, job: int, timeout: float) -> dict[str, str]:
        """Until the job is over. A requeued job restarts on SLURM's own schedule (cred_expire + 1 s,
        ~11 s here): `scontrol update StartTime=now` would be faster, but a launch within a second
        of the requeue is refused ("Job credential revoked") and the job ends FAILED 1:0."""
        deadline = time.monotonic() + timeout
        final = None
        while True:
            info = self.info(job)
            state = info.get("JobState")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                # A job that requeues itself passes through a terminal state before it is
                # PENDING again (seen once here): a state counts when it holds for 3 s.
                if final and final[0] == state and time.monotonic() - final[1] >= 3:
                    return info
                final = final if final and final[0] == state else (state, time.monotonic())
            else:
                final = None
            if time.monotonic() > deadline:
                self.cluster.cmd("scancel", str(job), check=False)
                raise AssertionError(
                    f"job {job} still {state} after {timeout} s\n{self.report(job)}"
                )
            time.sleep(1)

    def report(self, job: int) -> str:
        """For a failing assertion: the job's state, its output and the daemons' log tails."""
        info = self.info(job)
        keys = ("JobState", "Reason", "ExitCode", "Restarts", "NodeList")
        state = " ".join(f"{k}={info.get(k)}" for k in keys)
        return f"{state}\n--- job output\n{self.log(job)}\n{self.cluster.logs()}"

    def run_dir(self, exp: str, job: int) -> Path:
        return self.workdir / "outputs" / exp / f"slurm-{job}"

    def log(self, job: int) -> str:
        """The job's SLURM output file (every attempt, appended)."""
        files = list(self.workdir.glob(f"slurm-*-{job}.out"))
        return files[0].read_text(errors="replace") if files else "(no output file)"


@pytest.fixture
def jobs(slurm_cluster, tmp_path):
    os.chmod(tmp_path, 0o755)
    return Jobs(slurm_cluster, tmp_path)
