"""The house: what a clone of the repository promises about its own structure.

At most 12 modules at the top of ftcore/; its packages in the layers of docs/design.md (import-linter
over pyproject.toml's contracts: each package imports only those below it, no import cycle, lazy
imports included), with launch/ above them all; no reference from the package to a file outside
the repository; and a wheel that holds every module and config file (setuptools discovers the
packages: a new folder is never silently left out)."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter's own TOML reader
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ftcore"


def _lint_imports(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache", "--no-logo", *args], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip


def test_packages_keep_their_layers():
    """import-linter over pyproject.toml's contracts: every package of ftcore/ in a layer
    (exhaustive), each importing only the layers below it, lazy imports included; no import cycle
    among the modules of any package."""
    done = _lint_imports()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_layers_name_every_package_as_the_docs_do():
    """docs/design.md lists the layers in the contract's order, so the picture cannot drift."""
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in layers["contracts"] if c["id"] == "layers"]
    names = [n.strip() for layer in contract["layers"] for n in layer.split("|")]
    children = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    children |= {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(names) == sorted(children)
    design = (ROOT / "docs" / "design.md").read_text()
    picture = design[design.index("## Layers") :]
    picture = picture[: picture.index("\n## ", 1)]
    rows = [line for line in picture.splitlines() if line.startswith("| `")]
    in_docs = [[n.strip("`") for n in row.split("|")[1].split()] for row in rows]
    in_contract = [[n.strip() for n in layer.split("|")] for layer in contract["layers"]]
    assert in_docs == in_contract, "docs/design.md lists the layers of pyproject.toml, top first"


def test_nothing_in_the_package_imports_launch():
    """launch/ (installed as ftcore.launch) sits above every package of ftcore/; import-linter does
    not see it (it lives outside ftcore/), so this reads the imports itself."""
    bad = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "ftcore.launch" or n.startswith("ftcore.launch.") for n in names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == []


def test_at_most_twelve_top_level_modules():
    top = sorted(p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 12, top


def test_package_points_only_inside_the_repository():
    """No docstring or comment sends the reader to a file a clone does not have."""
    bad = []
    for folder in ("ftcore", "launch", "conf", "tools"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml", ".sh") and path.is_file():
                for i, line in enumerate(path.read_text().splitlines(), 1):
                    if "shared/" in line or "DESIGN.md" in line:
                        bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert bad == []


@pytest.mark.slow
def test_wheel_holds_every_module_and_config_file(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, text=True)  # fmt: skip
    # every data folder is a listed package: no "Package would be ignored" per folder at install
    assert "would be ignored" not in built.stdout + built.stderr
    assert "absent from the `packages`" not in built.stdout + built.stderr
    (wheel,) = tmp_path.glob("ftcore-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")}
    want |= {
        "ftcore/conf/" + str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")
    }
    want |= {
        "ftcore/launch/" + str(p.relative_to(ROOT / "launch"))
        for p in (ROOT / "launch").glob("*.py")
    }
    assert sorted(want - names) == []
