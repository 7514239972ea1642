"""Issue 51: one door for every file that came from elsewhere. No module of ftcore/ outside
ftcore/runtime/safe_files/ opens or parses a file itself (`open`, `Path.read_text`, `torch.load`,
`OmegaConf.load`, safetensors' `safe_open`/`load_file`, `json.load`, pickle, `datasets`' loaders,
numpy's, pyarrow's ...), except the short allow-list below of files ftcore wrote itself in this
run or ships, each with its reason: the next feature that reads a checkpoint, a model, an adapter,
data or a run directory goes through the door, or this test names it."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "ftcore"
DOOR = "ftcore/runtime/safe_files/"

# a call `x.<attr>(...)` of any x: each reads (or opens) a file by itself
ATTRS = {"read_text", "read_bytes", "open", "load_common_state_dict", "from_parquet",
         "from_pretrained", "read_table", "ParquetFile", "open_stream", "open_file", "memory_map",
         "memmap", "fromfile", "safe_open", "load_file", "load_from_disk", "load_dataset"}  # fmt: skip
# a call `<module>.<attr>(...)`
QUALIFIED = {("OmegaConf", "load"), ("torch", "load"), ("json", "load"), ("pickle", "load"),
             ("pickle", "loads"), ("yaml", "load"), ("yaml", "safe_load"), ("yaml", "full_load"),
             ("yaml", "unsafe_load"), ("np", "load"), ("numpy", "load"),
             ("dist_checkpointing", "load")}  # fmt: skip
# a call of a bare name (builtins, or names imported from the modules above)
NAMES = {"open", "safe_open", "load_file", "load_from_disk", "load_dataset"}
# importing these is reading with them
MODULES = {"pickle", "dill", "cloudpickle", "joblib"}

# (module, what it calls): why it may. Files ftcore wrote in this run, or ships.
ALLOWED = {
    (
        "ftcore/cli.py",
        "open",
    ): "a worker's error line into its launcher's private mkdtemp directory",
    ("ftcore/runtime/local_launch.py", "read_text"): "reads back those error lines (this run's)",
    ("ftcore/runtime/host_memory.py", "open"): "/proc/self: the kernel's, not a file",
    ("ftcore/runtime/run_lock.py", "open"): "the run's lock file, opened to be locked (O_NOFOLLOW, "
    "another user's refused); only the holder's JSON is read back, through safe_files.parse_json",
    ("ftcore/precision/ngc.py", "read_text"): "ftcore's own Dockerfile",
    ("ftcore/precision/ngc.py", "OmegaConf.load"): "ftcore's own conf/precision/*.yaml",
    ("ftcore/planner/fit.py", "open"): "the published rows ftcore ships (tests/data/*.csv)",
    ("ftcore/data/token_cache.py", "memmap"): "ftcore's cache entries, checked by read_header "
    "(owner, no links, sizes, SHA-256 of header and offsets) before they are mapped",
    ("ftcore/data/sources.py", "ParquetFile"): "a file object opened by safe_files.open_read",
    ("ftcore/data/sources.py", "open_stream"): "a file object opened by safe_files.open_read",
    ("ftcore/data/sources.py", "load_dataset"): "a data set name in the local HF cache, offline; "
    "its rows are measured in Arrow before they become Python (_arrow_rows)",
    ("ftcore/checkpoint/store.py", "dist_checkpointing.load"): "inside safe_files."
    "megatron_readers(): its `.metadata`, byte items and common.pt are read there",
    ("ftcore/bench/", "*"): "the benchmark harness: its own spec and result files, written by it "
    "in this run, and the HF recipe it times against (not part of a training run)",
    ("ftcore/assets/", "*"): "the asset makers: they write the bundled assets ftcore ships",
}


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """local name -> what it is (`module.name`), for `from m import n [as a]` and `import m as a`."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name
    return out


def direct_reads(source: str) -> list[tuple[int, str]]:
    """(line, call) of every direct file read in a module's source."""
    tree = ast.parse(source)
    names = _imported_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found += [
                (node.lineno, f"import {m}") for m in mods if m and m.split(".")[0] in MODULES
            ]
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name):
            real = names.get(f.id, f.id).rsplit(".", 1)[-1]
            if f.id in NAMES or real in NAMES:
                found.append((node.lineno, f.id))
        elif isinstance(f, ast.Attribute):
            base = f.value.id if isinstance(f.value, ast.Name) else None
            if base and names.get(base) == "ftcore.runtime.safe_files":
                continue  # the door itself
            base_real = names.get(base, base or "").rsplit(".", 1)[-1] if base else None
            if (base, f.attr) in QUALIFIED or (base_real, f.attr) in QUALIFIED:
                found.append((node.lineno, f"{base}.{f.attr}"))
            elif f.attr in ATTRS:
                found.append((node.lineno, f.attr))
    return found


def _allowed(rel: str, call: str) -> bool:
    return any(
        (rel == mod or (mod.endswith("/") and rel.startswith(mod))) and what in (call, "*")
        for mod, what in ALLOWED
    )


@functools.cache
def _reads(pkg: Path) -> tuple[tuple[str, int, str], ...]:
    """(module, line, call) of every direct read in the package outside the door (parsed once)."""
    out = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg.parent).as_posix()
        if not rel.startswith(DOOR):
            out += [(rel, line, call) for line, call in direct_reads(path.read_text())]
    return tuple(out)


def offenders(pkg: Path = PKG) -> list[str]:
    return [f"{rel}:{line}: {call}" for rel, line, call in _reads(pkg) if not _allowed(rel, call)]


def test_every_read_goes_through_the_door():
    assert offenders() == [], (
        "read these through ftcore.runtime.safe_files (or allow-list ones ftcore wrote)"
    )


def test_every_allowance_is_still_needed():
    """An allow-list entry whose call is gone is removed, so the list stays short and true."""
    used = {(m, w) for rel, _, call in _reads(PKG) for m, w in ALLOWED
            if rel.startswith(m) and w in (call, "*")}  # fmt: skip
    assert set(ALLOWED) - used == set()


# What a new feature might write; each must be caught.
NEW_READS = {
    "builtin open": "def f(p):\n    with open(p) as fh:\n        return fh.read()\n",
    "Path.read_text": "def f(p):\n    return p.read_text()\n",
    "Path.open": "def f(p):\n    return p.open('rb')\n",
    "torch.load": "import torch\ndef f(p):\n    return torch.load(p, weights_only=True)\n",
    "OmegaConf.load": "from omegaconf import OmegaConf\ndef f(p):\n    return OmegaConf.load(p)\n",
    "safe_open": "from safetensors import safe_open\ndef f(p):\n    return safe_open(p, 'pt')\n",
    "aliased load_file": "from safetensors.torch import load_file as lf\ndef f(p):\n    return lf(p)\n",
    "json.load": "import json\ndef f(fh):\n    return json.load(fh)\n",
    "pickle": "import pickle\n",
    "np.load": "import numpy as np\ndef f(p):\n    return np.load(p)\n",
    "load_dataset": "import datasets\ndef f(p):\n    return datasets.load_dataset(p)\n",
    "from_pretrained": "import transformers\ndef f(p):\n    return transformers.AutoTokenizer.from_pretrained(p)\n",
    "torch under another name": "import torch as t\ndef f(p):\n    return t.load(p)\n",
}


def test_a_new_direct_read_fails_the_test(tmp_path):
    """Each kind of direct read, added to a module of a copy of the package (here: hf/, where the
    FP8 checkpoint reads will go), makes `offenders` name it; the real package has none."""
    for what, code in NEW_READS.items():
        pkg = tmp_path / what.replace(" ", "_") / "ftcore"
        (pkg / "hf").mkdir(parents=True)
        (pkg / "hf" / "fp8_reader.py").write_text(code)
        (pkg / "runtime" / "safe_files").mkdir(parents=True)
        (pkg / "runtime" / "safe_files" / "parse.py").write_text(code)  # the door may
        found = offenders(pkg)
        assert len(found) == 1 and found[0].startswith("ftcore/hf/fp8_reader.py:"), (what, found)
