"""What every benchmark kind shares: the configurations of a benchmark (expand_runs), a fresh
process per configuration (launch, launch_taking_turns), and one JSON line per configuration
appended to outputs/bench/<name>/bench.jsonl (Bench.append). The kinds: bench/layouts.py and
bench/vs_hf.py; bench/dispatch.py picks one, bench/report.py writes bench.md/.png.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ftcore.bench import turns
from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")
# Variables that would make a child believe it is already a rank of some launcher.
LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
)  # fmt: skip
SPEC_ENV = "FTCORE_BENCH_SPEC"  # the JSON file a worker reads its job from
# What every configuration gets: no checkpoints, no eval, no export, plain log lines.
FIXED = [
    "checkpoint.resume=never",
    "checkpoint.interval=0",
    "checkpoint.save_at_end=false",
    "eval.interval=0",
    "logger.progress=lines",
    "logger.wandb.mode=disabled",
]


@dataclass
class Run:
    label: str
    overrides: list[str]
    env: dict = field(default_factory=dict)
    held_out: bool | None = None  # the planner's constants were not fitted to it (None: not said)


def _short(o: str) -> str:
    key, _, value = o.partition("=")
    return f"{key.lstrip('+').split('.')[-1]}={value}"


def expand_runs(bench: DictConfig) -> list[Run]:
    """bench.runs (lists of overrides or {label, overrides, env, held_out}), then the product of
    bench.sweep."""
    runs = []
    for i, r in enumerate(bench.runs):
        r = OmegaConf.to_container(r, resolve=True) if not isinstance(r, (str, list)) else r
        if isinstance(r, str):
            r = [r]
        if isinstance(r, list):
            r = {"overrides": r}
        ov = [str(o) for o in r.get("overrides", [])]
        label = r.get("label") or (",".join(_short(o) for o in ov) or f"run{i}")
        env = {str(k): str(v) for k, v in (r.get("env") or {}).items()}
        held = r.get("held_out")
        if held is not None and not isinstance(held, bool):
            raise FtcoreError(f"run {label}: held_out is {held!r}", field="bench.runs.held_out",
                              fix="true (the planner was not fitted to this run) or false")  # fmt: skip
        runs.append(Run(str(label), ov, env, held))
    sweep = OmegaConf.to_container(bench.sweep, resolve=True) if bench.sweep else {}
    if sweep:
        keys = list(sweep)
        values = [v if isinstance(v, list) else [v] for v in sweep.values()]
        for combo in itertools.product(*values):
            ov = [f"{k}={_value(v)}" for k, v in zip(keys, combo)]
            runs.append(Run(",".join(_short(o) for o in ov), ov))
    labels = [r.label for r in runs]
    dup = {x for x in labels if labels.count(x) > 1}
    if dup:
        raise FtcoreError(f"duplicate run labels {sorted(dup)}", field="bench.runs",
                          fix="give each run a distinct label")  # fmt: skip
    if not runs:
        raise FtcoreError("the benchmark has no runs", field="bench.runs",
                          fix="list runs (override lists) or a sweep in conf/bench/<name>.yaml")  # fmt: skip
    return runs


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def output_dir(bench: DictConfig) -> Path:
    return Path(bench.output_dir or Path("outputs") / "bench" / bench.name)


def machine() -> dict:
    """Where it ran: host, CPU, cores, GPU (if any) or one CPU thread's rates, packages."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform()}  # fmt: skip
    info["packages"] = package_versions()
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        else:  # the rates the planner's local_cpu prediction uses (host_probe)
            from ftcore.planner.host import probe

            info["probe"] = probe()
        info["torch"] = torch.__version__
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info


BENCH_PACKAGES = ("torch", "megatron-core", "transformers", "peft", "accelerate", "datasets")


def package_versions() -> dict[str, str]:
    """Installed versions of what a benchmark's numbers depend on: a fresh install can resolve a
    newer Hugging Face stack, which moved cpu_vs_hf's eval losses by ~1% with the same bench code."""
    from importlib import metadata

    out = {}
    for name in BENCH_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def git_commit() -> str | None:
    """The short commit, with "+dirty" when tracked files differ from it."""
    try:
        here = Path(__file__).parent
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=here)  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, cwd=here)  # fmt: skip
        commit = out.stdout.strip()
        return (commit + ("+dirty" if dirty.stdout.strip() else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def _child_env(extra: dict, spec_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(extra)
    env[SPEC_ENV] = str(spec_path)
    return env


def read_spec() -> dict:
    """A worker's side: the spec its runner wrote (`_prepare`), named by FTCORE_BENCH_SPEC."""
    return json.loads(Path(os.environ[SPEC_ENV]).read_text())


def write_result(spec: dict, result: dict) -> None:
    """A worker's side: its result JSON at spec["out"], whole or not at all (`_collect` reads it)."""
    tmp = Path(spec["out"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, spec["out"])


def _prepare(module: str, overrides: list[str], spec: dict, run_dir: Path,
             env: dict) -> tuple[list[str], dict, Path, Path]:  # fmt: skip
    """Write the worker's spec; (command, environment, log file, result file)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(run_dir / "result.json")}
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    logf = run_dir / "worker.log"
    cmd = [sys.executable, "-u", "-m", module, *overrides]
    logf.write_text("$ " + " ".join(cmd) + "\n")
    return cmd, _child_env(env, spec_path), logf, Path(spec["out"])


def _collect(rc, out: Path, logf: Path) -> tuple[dict | None, str]:
    if rc == 0 and out.exists():
        return json.loads(out.read_text()), ""
    tail = logf.read_text().strip().splitlines()[-6:]
    return None, f"exit {rc}: " + " | ".join(tail)


def launch(module: str, overrides: list[str], spec: dict, run_dir: Path, env: dict,
           timeout_s: float) -> tuple[dict | None, str]:  # fmt: skip
    """`python -m module overrides` in a fresh process; (its result JSON or None, error text)."""
    cmd, env, logf, out = _prepare(module, overrides, spec, run_dir, env)
    with open(logf, "a") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return _collect(rc, out, logf)


def launch_taking_turns(jobs: list[tuple], slices: int, timeout_s: float) -> list[tuple]:
    """Each job (module, overrides, spec, run_dir, env) in its own process, all alive at once and
    computing one at a time (ftcore.bench.turns); [(result JSON or None, error text)] in order."""
    prepared = [_prepare(*job) for job in jobs]
    logs = [open(logf, "a") for _, _, logf, _ in prepared]
    try:
        starts = [
            (lambda cmd=cmd, env=env, f=f: turns.spawn(cmd, env, f, slices))
            for (cmd, env, _, _), f in zip(prepared, logs)
        ]
        codes = turns.take_turns(starts, timeout_s * len(jobs))
    finally:
        for f in logs:
            f.close()
    return [_collect(rc, out, logf) for rc, (_, _, logf, out) in zip(codes, prepared)]


def layout_of(overrides: list[str]) -> dict:
    from ftcore.config.schema import compose

    cfg = compose(overrides)
    p, t = cfg.parallel, cfg.train
    nproc = cfg.launcher.nproc_per_node
    world = cfg.cluster.num_gpus or nproc
    return {
        "world": world, "nproc_per_node": nproc, "tp": p.tp, "pp": p.pp, "vp": p.vp, "cp": p.cp,
        "dp": world // (p.tp * p.pp * p.cp), "sp": bool(p.sp),
        "distributed_optimizer": bool(p.distributed_optimizer), "recompute": p.recompute,
        "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
        "seq_len": cfg.data.seq_len, "packing": bool(cfg.data.packing), "peft": cfg.peft.name,
        "precision": cfg.precision.name, "model": cfg.model.name, "cluster": cfg.cluster.name,
        "peak_bf16_tflops": cfg.cluster.peak_tflops.get("bf16"),
    }  # fmt: skip


class Bench:
    """One invocation: its id, where lines go, what every line carries."""

    def __init__(self, cfg: DictConfig, extra: list[str], command: str):
        self.cfg, self.bench, self.extra = cfg, cfg.bench, list(extra)
        self.out = output_dir(self.bench)
        self.out.mkdir(parents=True, exist_ok=True)
        self.invocation = time.strftime("%Y%m%d-%H%M%S")
        self.runs_dir = self.out / "runs" / self.invocation
        self.common = {
            "bench": self.bench.name,
            "kind": self.bench.kind,
            "invocation": self.invocation,
            "command": command,
            "machine": machine(),
            "commit": git_commit(),
            # what the command resolved to: the benchmark's definition and the overrides for every run
            "bench_config": OmegaConf.to_container(self.bench, resolve=True),
            "extra_overrides": list(extra),
        }
        self.timeout_s = float(self.bench.timeout_min) * 60

    def overrides(self, run: Run) -> list[str]:
        ov = [*self.bench.base, *run.overrides, *self.extra, *FIXED]
        if self.bench.threads:
            ov.append(f"launcher.threads_per_rank={int(self.bench.threads)}")
        return ov

    def append(self, line: dict) -> None:
        line = {**self.common, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **line}
        with open(self.out / "bench.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        status = line.get("status")
        done = (
            f"{line['wall_s']:.1f} s"
            if "wall_s" in line
            else f"{line.get('tokens_per_s', 0):.0f} tokens/s"
        )
        log.info("bench %s: %s %s", self.bench.name, line.get("label"),
                 status if status != "ok" else done)  # fmt: skip
