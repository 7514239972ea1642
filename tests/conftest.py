"""Shared fixtures: session-scoped gloo worker pools, one generate run that several command-line
tests read, GPU skipping."""

from __future__ import annotations

import os
import warnings

import pytest

from ftcore.runtime import megatron_jit
from tests.support.cli import LAUNCHER_ENV, QUESTION

megatron_jit.install()  # tests import megatron-core in this process too (as ftcore/cli.py does)
os.environ.setdefault("FTCORE_LOG_LEVEL", "WARNING")
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    # pytest-xdist workers (make test) share the cores: each worker's processes, this one and those
    # it starts, get their share of torch threads (set before torch is imported), or the OpenMP
    # threads of two workers' processes spin at their barriers on each other's cores.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (cores or 1) // _workers)))
warnings.filterwarnings("ignore")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="NOT RUN: no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_leaked_launcher_env():
    """A test (or a module fixture) that runs ftcore's setup inside this process makes it rank 0 of
    a one-process group, and ftcore.runtime.dist sets RANK, WORLD_SIZE, ... for it. A later
    subprocess test would inherit them and take itself for a launched rank waiting for its peers.
    The pytest process is never a launched rank: every test starts without
    them (the group already made keeps working)."""
    for k in LAUNCHER_ENV:
        os.environ.pop(k, None)
    yield


@pytest.fixture(scope="session")
def pool1():
    from tests.support.pool import Pool

    pool = Pool(1)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool2():
    from tests.support.pool import Pool

    pool = Pool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    from tests.support.pool import Pool

    pool = Pool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def base_answer(tmp_path_factory):
    """`python -m ftcore.generate +exp=tiny_lora` asking QUESTION of the bundled base (no adapter),
    as a user types it, from an empty directory, with a standard input that stays open and silent
    (reading it would hang until the timeout): (the process, that directory). One run (a process
    start costs ~15 s of CPU) read by test_quickstart (the inline prompt; generate writes nothing)
    and test_preflight (the base's answer, which an adapter must change)."""
    from tests.support.cli import cli

    cwd = tmp_path_factory.mktemp("base_answer")
    rfd, wfd = os.pipe()
    try:
        return cli("generate", "+exp=tiny_lora", *QUESTION, cwd=cwd, stdin=rfd), cwd
    finally:
        os.close(rfd)
        os.close(wfd)
