"""Shared fixtures: session-scoped gloo worker pools, a tiny run config, GPU skipping."""

from __future__ import annotations

import os
import warnings

import pytest

from ftcore.runtime import megatron_jit
from tests.support.cli import LAUNCHER_ENV

megatron_jit.install()  # tests import megatron-core in this process too (as ftcore/cli.py does)
os.environ.setdefault("FTCORE_LOG_LEVEL", "WARNING")
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
    a one-process group, and ftcore.runtime.dist sets RANK, WORLD_SIZE, MASTER_PORT, ... for it. A
    later subprocess test would inherit them, take itself for a launched rank and try to listen on
    that port (EADDRINUSE). The pytest process is never a launched rank: every test starts without
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
