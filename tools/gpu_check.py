"""`make gpu-check`: on a CUDA machine, run the GPU tests and a short 8B-shaped LoRA throughput run,
and write docs/gpu/<date>-<gpu>.md (what passed, what did NOT RUN and why, tokens/s/GPU measured
next to the planner's prediction, the versions of everything that matters).

It uses the machine's own Python and CUDA torch (never the CPU pins of `make setup`). Packages that
are missing are installed offline from a wheel folder (`make gpu-wheels PY=3.12` fills it on a
networked machine). Without CUDA it exits 2 with one line, before installing or writing anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the logs; --work moves them (a lent GPU machine returns one folder)
WORK = ROOT / "build" / "gpu-check"
# The throughput run: Llama 3 8B shapes (4 of its 32 layers), random base, LoRA on every linear.
TPUT = ["+exp=8b_lora", "model.num_layers=4", "model.allow_random_base=true", "cluster.num_gpus=null", "data.format=instruction",
        "train.global_batch_size=8", "train.max_steps=20", "eval.interval=0",
        "checkpoint.interval=0", "checkpoint.save_at_end=false", "logger.progress=lines"]  # fmt: skip
WARMUP = 5  # steps left out of the measured median
# conf/cluster files named in the GPU's device name (the planner predicts for it), in the order
# they are looked for: gb200 before b200
CLUSTERS = ("gb200", "gb300", "b200", "h200", "h100")


def cluster_of(gpu: str) -> list[str]:
    """The cluster override for this GPU; none (the experiment's own) for a GPU ftcore has none of."""
    name = gpu.lower()
    return next(([f"cluster={c}"] for c in CLUSTERS if c in name), [])


def cuda_or_exit() -> None:
    """The first thing done: no CUDA -> one line, exit 2."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        print(
            f"gpu-check: torch does not import here ({e}); run it on a CUDA machine",
            file=sys.stderr,
        )
        sys.exit(2)
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}); run it on a GPU machine", file=sys.stderr)  # fmt: skip
        sys.exit(2)


def missing_wheels(wheels: Path) -> list[Path]:
    """The wheels in the folder whose package is not installed."""
    out = []
    for whl in sorted(wheels.glob("*.whl")):
        name = whl.name.split("-")[0]
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            out.append(whl)
    return out


def install(wheels: Path) -> list[str]:
    """Offline installs: missing packages from the wheel folder, then ftcore itself (editable)."""
    done = []
    todo = missing_wheels(wheels) if wheels.is_dir() else []
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    if todo:
        subprocess.run([*pip, *map(str, todo)], check=True)
        done += [w.name for w in todo]
    try:
        import ftcore.conf  # noqa: F401
    except ImportError:
        subprocess.run([*pip, "--no-build-isolation", "-e", str(ROOT)], check=True)
        done.append("ftcore (editable)")
    return done


def log(msg: str) -> None:
    print(f"gpu-check {time.strftime('%H:%M:%S')}: {msg}", flush=True)


def timed_run(cmd: list[str], seconds: float, log_file: Path) -> tuple[int, str]:
    """Run cmd with its output going to log_file as it comes (a killed run still leaves its log);
    past `seconds` it is killed and reported as exit 124."""
    with open(log_file, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=max(seconds, 1)).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
            f.write(f"\ngpu-check: killed after {seconds:.0f} s (--budget)\n")
    return rc, log_file.read_text()


# What the test run uses beside pytest: tools/gpu_wheels.py downloads each (make gpu-wheels).
PLUGINS = ("pytest-timeout", "pytest-xdist")


def xdist_args(workers: int) -> list[str]:
    """Cases run as separate processes on the one GPU; pytest-xdist runs several at once."""
    try:
        metadata.version("pytest-xdist")
    except metadata.PackageNotFoundError:
        if workers > 1:
            print("gpu-check: pytest-xdist is not installed, so --workers is ignored (one test at "
                  "a time); make gpu-wheels downloads it", file=sys.stderr)  # fmt: skip
        return []
    return ["-n", str(workers)] if workers > 1 else []


def run_tests(junit: Path, seconds: float, per_test: int, workers: int):
    """pytest -m gpu tests/gpu -> [(test, outcome, reason)], and pytest's last line."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs",
           "-p", "no:cacheprovider", f"--junitxml={junit}", *xdist_args(workers)]  # fmt: skip
    try:
        metadata.version("pytest-timeout")
        cmd.append(f"--timeout={per_test}")
    except metadata.PackageNotFoundError:
        pass
    rc, text = timed_run(cmd, seconds, WORK / "pytest.log")
    rows, facts = parse_junit(junit)
    last = (text.strip().splitlines() or ["(no output)"])[-1]
    if rc == 124:
        last = f"killed at the time budget ({seconds:.0f} s); {last}"
    return rows, last, facts


def parse_junit(junit: Path):
    """[(test, outcome, reason)] and {test: {name: value}} of what the tests recorded with
    pytest's record_property (e.g. the host syncs per step and place of test_host_sync)."""
    rows, facts = [], {}
    if not junit.exists():
        return rows, facts
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"skipped": "NOT RUN"}.get(tag, "FAILED")
                reason = (
                    (el.get("message") or "").splitlines()[0][:200] if el.get("message") else ""
                )
        rows.append((name, outcome, reason))
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if props:
            facts[name] = props
    return rows, facts


def throughput(seconds: float, overrides: list[str]) -> dict:
    """The short 8B-shaped LoRA run: median measured tokens/s/GPU and the planner's prediction."""
    run_dir = ROOT / "build" / "gpu-check-tput"  # not under --work: a run dir holds many files
    cmd = [sys.executable, "-m", "ftcore.train", *overrides, f"run.dir={run_dir}"]
    rc, text = timed_run(cmd, seconds, WORK / "tput.log")
    out: dict = {"overrides": " ".join(overrides), "rc": rc}
    metrics = run_dir / "metrics.jsonl"
    if rc == 0 and metrics.exists():
        rates = [r["tokens_per_s_per_gpu"] for r in map(json.loads, metrics.read_text().split("\n")[:-1])
                 if "tokens_per_s_per_gpu" in r][WARMUP:]  # fmt: skip
        if rates:
            out["measured"] = sorted(rates)[len(rates) // 2]
            out["steps"] = rates
    else:
        out["error"] = (text.strip().splitlines() or ["?"])[-1][:300]
    plan = subprocess.run([sys.executable, "-m", "ftcore.plan", *overrides, "plan.format=json"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    (WORK / "plan.json").write_text(plan.stdout + plan.stderr)
    try:
        out["predicted"] = json.loads(plan.stdout)["tokens_per_s_per_gpu"]
    except (ValueError, KeyError):
        out["predicted"] = None
    return out


def profile(seconds: float, overrides: list[str]) -> list[str]:
    """tools/gpu_profile.py on the throughput run's config: the GPU's busy share of a step and
    the full op tables (profile.txt beside the logs); its summary lines, or why there are none."""
    if seconds < 45:
        return [f"not run: {seconds:.0f} s of --budget left"]
    out = WORK / "profile.txt"
    cmd = [sys.executable, "tools/gpu_profile.py", str(out), *overrides,
           f"run.dir={ROOT / 'build' / 'gpu-check-profile'}"]  # fmt: skip
    rc, text = timed_run(cmd, seconds, WORK / "profile.log")
    if rc != 0 or not out.exists():
        return [f"did not finish (exit {rc}): {(text.strip().splitlines() or ['?'])[-1][:300]}"]
    return out.read_text().splitlines()[1:3]


def versions() -> dict[str, str]:
    import torch

    def ver(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    te = next((v for v in map(ver, ("transformer_engine", "transformer-engine")) if v != "not installed"),
              "not installed")  # fmt: skip
    return {"python": platform.python_version(), "torch": torch.__version__,
            "CUDA (torch build)": str(torch.version.cuda), "transformer-engine": te,
            "megatron-core": ver("megatron-core"), "transformers": ver("transformers"),
            "peft": ver("peft"), "bitsandbytes": ver("bitsandbytes")}  # fmt: skip


def report(gpu: str, installed, rows, last, tput, vers, commit=None, facts=None) -> str:
    today = datetime.date.today().isoformat()
    commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                      capture_output=True, text=True).stdout.strip() or "?"  # fmt: skip
    lines = [f"# make gpu-check, {today}, {gpu}", "", f"Commit {commit}. Installed offline for this "
             f"run: {', '.join(installed) or 'nothing'}.", "", "## Versions", ""]  # fmt: skip
    lines += [f"- {k}: {v}" for k, v in vers.items()]
    lines += ["", f"## GPU tests (`pytest -m gpu tests/gpu`): {last}", "", "| test | result | why |",
              "|---|---|---|"]  # fmt: skip
    lines += [f"| {n} | {o} | {r.replace('|', '/')} |" for n, o, r in rows]
    if facts:
        lines += [
            "",
            "What the tests recorded (per step: host syncs by the place that made them):",
            "",
        ]
        lines += [
            f"- {n}: {k} = {v}" for n, props in sorted(facts.items()) for k, v in props.items()
        ]
    pred, meas = tput.get("predicted"), tput.get("measured")
    lines += [
        "",
        "## Throughput (8B-shaped LoRA, random base)",
        "",
        f"`python -m ftcore.train {tput['overrides']}`",
        "",
    ]
    if meas is None:
        lines.append(f"Did not finish (exit {tput['rc']}): {tput.get('error', 'no metrics')}")
    else:
        ratio = f" ({meas / pred:.2f} x the prediction)" if pred else ""
        lines.append(f"- measured: {meas:,.0f} tokens/s/GPU (median of steps {WARMUP + 1}+){ratio}")
        lines.append(f"- each of those steps: {', '.join(f'{r:,.0f}' for r in tput['steps'])}")
    lines.append(f"- planner predicted: {f'{pred:,.0f}' if pred else 'n/a'} tokens/s/GPU")
    if vers["transformer-engine"] == "not installed":
        lines.append("- the run used megatron's local layers (no Transformer Engine here); the "
                     "planner's speed is fitted to published runs with Transformer Engine")  # fmt: skip
    if "profile" in tput:
        lines += ["", "## Where a step's time goes (`tools/gpu_profile.py`, same config)", ""]
        lines += [f"- {ln}" for ln in tput["profile"]]
    return "\n".join(lines) + "\n"


def report_path(folder: Path, day: str, gpu: str) -> Path:
    """<day>-<gpu>.md, or -2, -3, ... after it: a second run on the same day keeps the first's."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    names = (f"{day}-{slug}{'' if k == 1 else f'-{k}'}.md" for k in range(1, 1000))
    return next(folder / n for n in names if not (folder / n).exists())


def main() -> int:
    global WORK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", default=str(ROOT / ".whl"), help="offline wheel folder")
    ap.add_argument("--out", default=str(ROOT / "docs" / "gpu"), help="where the report goes")
    ap.add_argument("--work", default=str(WORK), help="where the logs go")
    ap.add_argument("--budget", type=float, default=3600, help="seconds for tests + throughput")
    ap.add_argument("--test-timeout", type=int, default=300, help="seconds per GPU test")
    ap.add_argument("--workers", type=int, default=4, help="GPU tests at once (pytest-xdist)")
    ap.add_argument("--commit", help="the commit tested, where the copy's git does not know it")
    args = ap.parse_args()
    cuda_or_exit()  # before anything is installed or written
    import torch

    WORK = Path(args.work)
    WORK.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    installed = install(Path(args.wheels))
    log(f"installed offline: {', '.join(installed) or 'nothing'}; GPU tests next")
    rows, last, facts = run_tests(WORK / "junit.xml", 0.7 * args.budget, args.test_timeout,
                                  args.workers)  # fmt: skip
    log(f"GPU tests: {last}; throughput run next")
    gpu = torch.cuda.get_device_name(0)
    overrides = [*TPUT, *cluster_of(gpu)]
    tput = throughput(args.budget - (time.monotonic() - start), overrides)
    tput["profile"] = profile(args.budget - (time.monotonic() - start), overrides)
    text = report(gpu, installed, rows, last, tput, versions(), args.commit, facts)
    out = report_path(Path(args.out), datetime.date.today().isoformat(), gpu)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"gpu-check: wrote {out}")
    failed = any(o == "FAILED" for _, o, _ in rows) or "measured" not in tput
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
