"""The data pipeline under a process group: rank 0 tokenizes while the others wait and read its
cache, memory-mapping the one file it wrote; on nodes with their own cache directory the local
rank 0 of each node builds it once there; a data error stops every rank alike (no rank left waiting at a barrier); the DP ranks'
slices of a global batch are disjoint and together the single-process global batch."""

from __future__ import annotations

import json

import pytest

from ftcore.config.schema import compose
from ftcore.data import tokenized
from ftcore.data.pipeline import build_train_loader
from ftcore.data.tokenizer import load_tokenizer
from ftcore.errors import FtcoreError


def _cfg(path, cache):
    return compose([f"data.path={path}", f"data.cache_dir={cache}", "data.seq_len=64",
                    "train.global_batch_size=8", "train.micro_batch_size=2", "data.packing=true"])  # fmt: skip


def build_counting(path: str, cache: str, node_local: bool = False) -> dict:
    """Every rank builds its loader; how many times this rank tokenized, the file its tokens are
    mapped from, and its rows. `node_local`: every rank plays the local rank 0 of its own node,
    with a cache directory of its own (a node-local disk)."""
    import os

    import torch.distributed as dist

    local = os.environ["LOCAL_RANK"]
    if node_local:
        os.environ["LOCAL_RANK"] = "0"
        cache = f"{cache}/node{dist.get_rank()}"
    calls = []
    real = tokenized._build
    tokenized._build = lambda *a: calls.append(1) or real(*a)
    try:
        cfg = _cfg(path, cache)
        dp = dist.get_world_size()
        ld = build_train_loader(cfg, load_tokenizer(cfg), dist.get_rank(), dp)
        mapped = ld.docs.docs.sources[0].ids.filename
        return {"builds": len(calls), "rows": [ld.next_rows() for _ in range(3)], "file": mapped}
    finally:
        tokenized._build = real
        os.environ["LOCAL_RANK"] = local


def build_error(path: str, cache: str) -> str:
    cfg = _cfg(path, cache)
    try:
        build_train_loader(cfg, load_tokenizer(cfg), 0, 1)
    except FtcoreError as e:
        return str(e)
    return "no error"


@pytest.mark.dist
def test_rank0_builds_the_cache_others_read_it(pool2, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"What is {i} + 1?", "output": str(i + 1)}) + "\n"
                            for i in range(50)))  # fmt: skip
    r0, r1 = pool2.run(build_counting, str(data), str(tmp_path / "cache"))
    assert (r0["builds"], r1["builds"]) == (1, 0)
    assert r0["file"] == r1["file"] and len(list((tmp_path / "cache").iterdir())) == 1
    single = build_train_loader(_cfg(data, tmp_path / "cache"), load_tokenizer(compose([])), 0, 1)
    for step in range(3):
        assert r0["rows"][step] + r1["rows"][step] == single.next_rows()


@pytest.mark.dist
def test_each_node_builds_its_own_cache_once(pool2, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"What is {i} + 3?", "output": str(i + 3)}) + "\n"
                            for i in range(50)))  # fmt: skip
    r0, r1 = pool2.run(build_counting, str(data), str(tmp_path / "cache"), True)
    assert (r0["builds"], r1["builds"]) == (1, 1) and r0["file"] != r1["file"]
    for node in ("node0", "node1"):
        assert len(list((tmp_path / "cache" / node).iterdir())) == 1
    single = build_train_loader(_cfg(data, tmp_path / "one"), load_tokenizer(compose([])), 0, 1)
    for step in range(3):
        assert r0["rows"][step] + r1["rows"][step] == single.next_rows()


@pytest.mark.dist
def test_data_error_raised_on_every_rank(pool2, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": 1, "output": "b"}\n')
    msgs = pool2.run(build_error, str(data), str(tmp_path / "cache"), timeout=120)
    assert all(f"{data}:2:" in m for m in msgs), msgs
