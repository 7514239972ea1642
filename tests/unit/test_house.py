"""The house: what a clone of the repository promises about its own structure.

At most 12 modules at the top of ftcore/, no import cycle among ftcore's modules (imports inside
functions included), no reference from the package to a file outside the repository, and a wheel
that holds every module and config file (setuptools discovers the packages: a new folder is never
silently left out)."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ftcore"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every ftcore module `name` imports, at any depth (lazy imports count)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            for a in node.names:
                if f"{base}.{a.name}" in known:  # `from ftcore.pkg import module`
                    out.add(f"{base}.{a.name}")
                elif base in known:
                    out.add(base)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_lazy_cycle(tmp_path):
    """The checker itself: a cycle closed only by an import inside a function is found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from ftcore.b import f\n")
    b.write_text("def f():\n    from ftcore.a import g\n")
    known = {"ftcore.a", "ftcore.b"}
    graph = {"ftcore.a": _imports(a, "ftcore.a", known), "ftcore.b": _imports(b, "ftcore.b", known)}
    assert _cycles(graph) == [["ftcore.a", "ftcore.b"]]


def test_no_import_cycle_among_ftcore_modules():
    mods = _modules()
    # a package's __init__ is imported with any of its modules: count the edge only if it imports
    graph = {name: _imports(path, name, set(mods)) for name, path in mods.items()}
    assert _cycles(graph) == []


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
