"""Run a benchmark's configurations, each in a fresh process, and append one JSON line per
configuration to outputs/bench/<name>/bench.jsonl (then ftcore.bench_report writes bench.md/.png).

Two kinds (bench.kind):
- layouts: every configuration runs bench.warmup_steps + bench.measure_steps training steps
  (ftcore.bench_worker); the line holds the layout, tokens/s, step time (median, spread), model
  TFLOP/s/GPU, MFU, peak memory, the time split, and the planner's prediction beside it;
- cpu_vs_hf: the HF Trainer recipe and each ftcore configuration train one epoch over the same
  documents (ftcore.bench_vs_hf).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ftcore import bench_turns
from ftcore.bench_worker import PARTS, median_spread
from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")
# Variables that would make a child believe it is already a rank of some launcher.
LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
)  # fmt: skip
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


def _short(o: str) -> str:
    key, _, value = o.partition("=")
    return f"{key.lstrip('+').split('.')[-1]}={value}"


def expand_runs(bench: DictConfig) -> list[Run]:
    """bench.runs (lists of overrides or {label, overrides, env}), then the product of bench.sweep."""
    runs = []
    for i, r in enumerate(bench.runs):
        r = OmegaConf.to_container(r, resolve=True) if not isinstance(r, (str, list)) else r
        if isinstance(r, str):
            r = [r]
        if isinstance(r, list):
            r = {"overrides": r}
        ov = [str(o) for o in r.get("overrides", [])]
        label = r.get("label") or (",".join(_short(o) for o in ov) or f"run{i}")
        runs.append(Run(str(label), ov, {str(k): str(v) for k, v in (r.get("env") or {}).items()}))
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
    info = {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count()}
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
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).parent)  # fmt: skip
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _child_env(extra: dict, spec_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(extra)
    env["FTCORE_BENCH_SPEC"] = str(spec_path)
    return env


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
    computing one at a time (ftcore.bench_turns); [(result JSON or None, error text)] in order."""
    prepared = [_prepare(*job) for job in jobs]
    logs = [open(logf, "a") for _, _, logf, _ in prepared]
    try:
        starts = [
            (lambda cmd=cmd, env=env, f=f: bench_turns.spawn(cmd, env, f, slices))
            for (cmd, env, _, _), f in zip(prepared, logs)
        ]
        codes = bench_turns.take_turns(starts, timeout_s * len(jobs))
    finally:
        for f in logs:
            f.close()
    return [_collect(rc, out, logf) for rc, (_, _, logf, out) in zip(codes, prepared)]


def predict(overrides: list[str]) -> dict | None:
    """The planner's prediction for a configuration (its local_cpu calibration on CPU)."""
    from ftcore import planner
    from ftcore.config import compose

    try:
        cfg = compose(overrides)
        if cfg.model.hf_path:
            from ftcore.hf.config import merge_hf_config

            cfg = merge_hf_config(cfg)
        world = cfg.cluster.num_gpus or cfg.launcher.nproc_per_node
        p = planner.plan(cfg, world)
    except Exception as e:  # noqa: BLE001 - a prediction that fails leaves the run standing
        log.warning("bench: no prediction for %s: %s", overrides, e)
        return None
    return {
        "tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"],
        "step_time_s": p["step_time_s"],
        "model_tflops_per_gpu": p["model_tflops_per_gpu"],
        "mfu": p["mfu"],
        "memory_gib": p["memory_gib"]["total"],
        "fits": p["fits"],
        "step_time_parts_s": p["step_time_parts_s"],
    }


def layout_of(overrides: list[str]) -> dict:
    from ftcore.config import compose

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


def summarize(result: dict, layout: dict) -> dict:
    """The measured part of a line: steps after warm-up only."""
    steps = [s for s in result["steps"] if not s["warmup"]]
    world = result["world"]
    times = [s["step_time_s"] for s in steps]
    med, spread = median_spread(times)
    total_t = sum(times) or float("nan")
    tokens = sum(s["tokens"] for s in steps)
    targets = sum(s["target_tokens"] for s in steps)
    slot = layout["global_batch_size"] * layout["seq_len"]
    tps = tokens / total_t
    tflops = result["flops_per_token"] * tps / world / 1e12
    split = {}
    for part in PARTS:
        per_rank = [statistics.fmean(p[part] for p, s in zip(rank, result["steps"]) if not s["warmup"])
                    for rank in result["parts_by_rank"]] if steps else [0.0]  # fmt: skip
        split[part] = statistics.fmean(per_rank)
    split["other"] = max(0.0, (total_t / max(len(steps), 1)) - sum(split.values()))
    peak = layout.get("peak_bf16_tflops")
    measured = [i for i, s in enumerate(result["steps"]) if not s["warmup"]]
    cpu_rows = [r for r in result.get("cpu_by_rank", []) if r and None not in r]
    cpu = [max(r[i] for r in cpu_rows) for i in measured] if cpu_rows else []
    return {
        "cpu_step_s": statistics.median(cpu) if cpu else None,
        "steps_measured": len(steps),
        "step_time_s": med,
        "step_time_spread": spread,
        "step_time_min_s": min(times) if times else None,
        "step_time_max_s": max(times) if times else None,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / world,
        "target_tokens_per_s": targets / total_t,
        "slot_tokens_per_s_per_gpu": slot / med / world,
        "model_tflops_per_gpu": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_mem_gib": result["peak_mem_gib"],
        "time_split_s": split,
        "losses": [s["loss"] for s in result["steps"]],
        "threads": result.get("threads"),
    }


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
        log.info("bench %s: %s %s", self.bench.name, line.get("label"),
                 status if status != "ok" else f"{line.get('tokens_per_s', 0):.0f} tokens/s")  # fmt: skip


def run_layouts(b: Bench) -> None:
    from ftcore.planner import host

    warm, meas = int(b.bench.warmup_steps), int(b.bench.measure_steps)
    for run in expand_runs(b.bench):
        ov = b.overrides(run) + [f"train.max_steps={warm + meas}"]
        rdir = b.runs_dir / run.label
        ov.append(f"run.dir={rdir}")
        line = {"label": run.label, "overrides": run.overrides, "env": run.env}
        try:
            layout = layout_of(ov)
        except FtcoreError as e:
            b.append({**line, "status": "failed", "error": str(e)})
            continue
        host.probe.cache_clear()  # a VM's speed drifts by 20-40% over minutes: rates of now
        predicted = predict(ov)  # (measured again where the cluster asks: cluster.host_probe)
        rates = host.probe() if host.probe.cache_info().currsize else None
        load0 = load_avg()
        log.info("bench %s: running %s", b.bench.name, run.label)
        result, err = launch("ftcore.bench_worker", ov, {"warmup": warm, "measure": meas},
                             rdir, run.env, b.timeout_s)  # fmt: skip
        line.update(layout=layout, predicted=predicted, load_avg=[load0, load_avg()])
        if rates:
            line["host_probe"] = rates
        if result is None:
            b.append({**line, "status": "failed", "error": err})
            continue
        m = summarize(result, layout)
        if predicted:
            m["measured_over_predicted"] = predicted["step_time_s"] / m["step_time_s"]
            if m["cpu_step_s"]:
                m["measured_over_predicted_cpu"] = predicted["step_time_s"] / m["cpu_step_s"]
        b.append({**line, "status": "ok", **m})


def run_bench(cfg: DictConfig, extra: list[str], command: str) -> Path:
    """Run every configuration of cfg.bench; returns the output directory."""
    from ftcore import bench_report
    from ftcore.bench_vs_hf import run_cpu_vs_hf

    kinds = {"layouts": run_layouts, "cpu_vs_hf": run_cpu_vs_hf}
    if cfg.bench.kind not in kinds:
        raise FtcoreError(f"unknown kind {cfg.bench.kind!r}", field="bench.kind",
                          fix="layouts or cpu_vs_hf")  # fmt: skip
    expand_runs(cfg.bench)  # exit 2 on a malformed list before anything starts
    b = Bench(cfg, extra, command)
    log.info(
        "bench %s: %s -> %s (load average %s)", cfg.bench.name, cfg.bench.kind, b.out, load_avg()
    )
    kinds[cfg.bench.kind](b)
    bench_report.write(b.out)
    return b.out
