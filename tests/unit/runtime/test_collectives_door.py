"""The one door for collectives (runtime/collectives.py, issue 50): no torch.distributed collective
outside ftcore/runtime/ (an AST scan of ftcore/ and launch/, shown to catch a planted call in each
form it can take), and the door refusing, on the CPU, a host tensor where a GPU cluster has NCCL.

On the CPU every group is gloo and every tensor a host tensor, so the door sees the device the GPU
path would give a tensor only inside the device audit (runtime/device_audit.py), as a CPU test
runs it; outside it a CPU run checks nothing (nothing there is wrong for gloo)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
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
    assert ROOT / "ftcore" / "training" / "ref_store.py" in files and len(files) > 100
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


def door_case() -> dict:
    """Worker: what the door refuses, outside and inside the device audit."""
    from megatron.core import parallel_state as ps

    from ftcore.runtime import collectives, device_audit
    from ftcore.runtime.dist import comm_device

    def refused(fn) -> str | None:
        try:
            fn()
        except collectives.HostTensorInCollective as e:
            return str(e)
        return None

    out = {"cpu run": refused(lambda: collectives.all_reduce(torch.ones(2)))}
    with device_audit.shadow_devices():
        ps.initialize_model_parallel(create_gloo_process_groups=True)
        tp, dp_gloo = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group_gloo()
        on_gpu = lambda: torch.zeros(2, device=comm_device())  # noqa: E731
        out.update({
            "host, default group": refused(lambda: collectives.all_reduce(torch.tensor([1.0]))),
            "host, tp group": refused(lambda: collectives.all_reduce(torch.zeros(2), group=tp)),
            "host, dp gloo group": refused(lambda: collectives.all_reduce(torch.zeros(2), group=dp_gloo)),
            "device, default group": refused(lambda: collectives.all_reduce(on_gpu())),
            "host output of a gather": refused(lambda: collectives.all_gather([torch.zeros(2)], on_gpu())),
            "host, broadcast": refused(lambda: collectives.broadcast(torch.zeros(2).cpu(), src=0)),
            "object with a device tensor": refused(lambda: collectives.all_gather_object([None], {"w": [on_gpu()]})),
            "object with a host tensor": refused(lambda: collectives.all_gather_object([None], {"w": on_gpu().cpu()})),
        })  # fmt: skip
        gloo, plain = collectives.new_group([0], backend="gloo"), collectives.new_group([0])
        out["backends"] = {name: collectives.gpu_backend(g) for name, g in
                           [("default", None), ("tp", tp), ("dp gloo", dp_gloo), ("new gloo", gloo),
                            ("new", plain)]}  # fmt: skip
    return out


@pytest.mark.dist
def test_the_door_refuses_a_host_tensor_where_nccl_would_be_used(pool1):
    out = pool1.run(door_case)[0]
    assert out.pop("backends") == {"default": "nccl", "tp": "nccl", "dp gloo": "gloo",
                                   "new gloo": "gloo", "new": "nccl"}  # fmt: skip
    refused = {k for k, v in out.items() if v}
    assert refused == {"host, default group", "host, tp group", "host output of a gather",
                       "host, broadcast", "object with a device tensor"}, out  # fmt: skip
    msg = out["host, default group"]
    assert msg.startswith("all_reduce on a nccl group got a host tensor (1,)") and "Fix:" in msg
    assert "comm_device()" in msg and "test_collectives_door.py" in msg  # where it was made
    assert (
        "all_gather_object" in out["object with a device tensor"]
        and ".cpu()" in out["object with a device tensor"]
    )
