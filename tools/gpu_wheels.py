"""`make gpu-wheels PY=3.12`: on a networked machine, download the wheels ftcore needs on a GPU node
that has only a CUDA PyTorch, transformers and peft, so `make gpu-check` installs them offline.

Which wheels: pip resolves ftcore's dependencies together with torch, transformers and peft for the
target Python and manylinux x86_64 (`pip install --dry-run --report`: metadata only, nothing big is
downloaded); everything torch, transformers or peft pull in themselves is what the bare image
already has, the rest is downloaded (`pip download --no-deps`, exact versions). Versions installed
here (the CPU-tested ones: megatron-core, hydra, ...) are pinned. Lazy extras are left out unless
asked for: wandb (only for logger.wandb.mode != disabled) and datasets (only for HF dataset sources).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
BARE = ("torch", "transformers", "peft")  # what the GPU image brings, with all it depends on
LAZY = ("wandb", "datasets")  # imported only when a feature asks; --with adds them back
# the GPU tests: pytest and the plugins tools/gpu_check.py uses (timeouts, --workers), bitsandbytes
# for QLoRA
TEST = ("pytest", "pytest-timeout", "pytest-xdist", "bitsandbytes")
# Published as source only (hydra's parser runtime): built here into a pure-Python wheel.
SOURCE_ONLY = ("antlr4-python3-runtime==4.9.3",)
LIMIT_MIB = 64
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip


def ftcore_requirements() -> list[Requirement]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def pinned(name: str) -> str:
    """name==version as installed here (the CPU-tested version), else just the name."""
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def target_flags(py: str) -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", py, "--implementation", "cp"]
    for p in PLATFORMS:
        flags += ["--platform", p]
    return flags


def build_source_only(dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), *SOURCE_ONLY]
    subprocess.run(cmd, check=True)


def resolve(roots: list[str], py: str, local: Path) -> dict[str, dict]:
    """pip's resolution of roots + the bare image's packages: name -> report item."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
               "--target", str(Path(tmp) / "t"), "--report", str(report), *target_flags(py),
               "--find-links", str(local), *roots, *BARE]  # fmt: skip
        subprocess.run(cmd, check=True)
        items = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i for i in items}


def closure(names, items: dict[str, dict], py: str) -> set[str]:
    env = {"python_version": py, "python_full_version": f"{py}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}  # fmt: skip
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name not in items:
            continue
        seen.add(name)
        for r in items[name]["metadata"].get("requires_dist", []):
            req = Requirement(r)
            if req.marker is None or Marker(str(req.marker)).evaluate(env):
                todo.append(canonicalize_name(req.name))
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default="3.12", help="target Python version, e.g. 3.12")
    ap.add_argument("--dest", default=str(ROOT / ".whl"))
    ap.add_argument("--with", dest="extra", action="append", default=[], choices=LAZY)
    args = ap.parse_args()
    if not re.fullmatch(r"3\.\d+", args.python):
        print(f"gpu-wheels: PY={args.python} is not a Python version like 3.12", file=sys.stderr)
        return 2
    skip = {canonicalize_name(n) for n in (*BARE, *LAZY) if n not in args.extra}
    roots = [pinned(r.name) for r in ftcore_requirements() if canonicalize_name(r.name) not in skip]
    roots += [pinned(n) for n in TEST]
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # one version of each: two stop an offline install
        old.unlink()
    build_source_only(dest)
    items = resolve(roots, args.python, dest)
    bare = closure(BARE, items, args.python)
    wanted = sorted(closure([Requirement(r).name for r in roots], items, args.python) - bare)
    built = {canonicalize_name(Requirement(r).name) for r in SOURCE_ONLY}
    specs = [f"{n}=={items[n]['metadata']['version']}" for n in wanted if n not in built]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest),
           *target_flags(args.python), *specs]  # fmt: skip
    subprocess.run(cmd, check=True)
    files = sorted(dest.glob("*.whl"))
    mib = sum(f.stat().st_size for f in files) / 2**20
    for f in files:
        print(f"  {f.stat().st_size / 2**20:7.2f} MiB  {f.name}")
    print(f"gpu-wheels: {len(files)} wheels for Python {args.python} in {dest}: {mib:.1f} MiB")
    if mib > LIMIT_MIB:
        print(f"gpu-wheels: more than {LIMIT_MIB} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
