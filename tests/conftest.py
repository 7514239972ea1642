"""Shared fixtures: session-scoped gloo worker pools, a tiny run config, GPU skipping."""

from __future__ import annotations

import os
import warnings

import pytest

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


@pytest.fixture(scope="session")
def pool1():
    from tests.dist.pool import Pool

    pool = Pool(1)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool2():
    from tests.dist.pool import Pool

    pool = Pool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    from tests.dist.pool import Pool

    pool = Pool(4)
    yield pool
    pool.close()
