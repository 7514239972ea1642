"""The one door for collectives (runtime/collectives.py, issue 50): no torch.distributed collective
outside ftcore/runtime/ (an AST scan of ftcore/ and launch/, shown to catch a planted call in each
form it can take), and the door refusing, on the CPU, a host tensor where a GPU cluster has NCCL.

On the CPU every group is gloo and every tensor a host tensor, so the door sees the device the GPU
path would give a tensor only inside the device audit (runtime/device_audit.py), as a CPU test
runs it; outside it a CPU run checks nothing (nothing there is wrong for gloo). The door's refusals
run in tests/multiproc/test_device_audit.py (its process pool)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ("ftcore", "launch")
DOOR = ROOT / "ftcore" / "runtime"  # the only place that calls torch.distributed's collectives
# torch.distributed's collectives, point-to-point calls and group creation (the door records a
# group's backend): what only ftcore/runtime/ may call
FORBIDDEN = (
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list", "new_group", "new_subgroups",
)  # fmt: skip
MODULE = "torch.distributed"


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def direct_collectives(source: str) -> list[tuple[int, str]]:
    """(line, what) of each torch.distributed collective the source imports, calls or names."""
    tree = ast.parse(source)
    aliases = {"torch": "torch"}  # local name -> the module it is
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.startswith(MODULE):
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full.startswith(MODULE):
                    if a.name in FORBIDDEN:
                        found.append((node.lineno, f"from {node.module} import {a.name}"))
                    aliases[a.asname or a.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN:
            name = _dotted(node.value)
            if name is None:
                continue
            head, _, rest = name.partition(".")
            module = ".".join(filter(None, [aliases.get(head, ""), rest]))
            if module.startswith(MODULE):
                found.append((node.lineno, f"{name}.{node.attr}"))
    return sorted(found)


def scanned_files() -> list[Path]:
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if DOOR not in p.parents]


def test_the_forbidden_names_are_torch_distributed_functions():
    assert [n for n in FORBIDDEN if not callable(getattr(dist, n, None))] == []


def test_no_collective_outside_the_door():
    files = scanned_files()
    assert (
        ROOT / "ftcore" / "training" / "objectives" / "dpo" / "ref_store.py" in files
        and len(files) > 100
    )
    assert ROOT / "ftcore" / "runtime" / "collectives.py" not in files
    found = {
        str(p.relative_to(ROOT)): hits for p in files if (hits := direct_collectives(p.read_text()))
    }
    assert found == {}, f"call these through ftcore.runtime.collectives: {found}"


PLANTED = {
    "alias": "import torch.distributed as dist\ndist.all_reduce(t)\n",
    "full path": "import torch\ntorch.distributed.barrier()\n",
    "submodule": "import torch.distributed\ntorch.distributed.all_gather_object(out, x)\n",
    "from torch": "from torch import distributed as d\nd.broadcast(t, 0)\n",
    "from import": "from torch.distributed import gather_object\ngather_object(x)\n",
    "c10d": "import torch.distributed.distributed_c10d as c10d\nc10d.all_reduce(t)\n",
    "lazy": "def f(t):\n    import torch.distributed as dist\n\n    return dist.all_gather(o, t)\n",
    "reference": "import torch.distributed as dist\nfn = dist.reduce_scatter\n",
    "group": "import torch.distributed as dist\ng = dist.new_group([0], backend='gloo')\n",
}
ALLOWED = """import torch.distributed as dist
from ftcore.runtime import collectives

if dist.is_initialized() and dist.get_world_size() > 1:
    collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    rank = dist.get_rank(g)
all_reduce = None
x.all_reduce(t)
"""


@pytest.mark.parametrize("form", list(PLANTED))
def test_a_planted_direct_call_is_found(form):
    assert len(direct_collectives(PLANTED[form])) >= 1, form


def test_queries_and_the_door_are_allowed():
    assert direct_collectives(ALLOWED) == []
