"""How a rank joins its process group: on GPU the NCCL group is told its device (no guess from the
global rank), on CPU gloo is given none. NCCL cannot run here, so the group's creation is recorded
instead of made; the device choice is ftcore's own code, which runs unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ftcore.config.schema import compose
from ftcore.runtime import dist as rdist
from tests.support.tiny import TINY


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    for k, v in dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    yield calls
    rdist.set_comm_device(torch.device("cpu"))


def test_gpu_rank_names_its_device(monkeypatch, recorded):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    info = rdist.init_distributed(compose([*TINY, "cluster=h100", "cluster.num_gpus=null"]))
    (kw,) = recorded
    assert kw["backend"] == rdist.GPU_BACKEND and kw["rank"] == 3 and kw["world_size"] == 8
    assert kw["device_id"] == torch.device("cuda", 1) == info.device  # LOCAL_RANK, not rank % gpus


def test_cpu_rank_names_no_device(monkeypatch, recorded):
    threads = torch.get_num_threads()
    try:
        rdist.init_distributed(compose([*TINY, "launcher.threads_per_rank=1"]))
    finally:
        torch.set_num_threads(threads)
    (kw,) = recorded
    assert kw["backend"] == "gloo" and kw["device_id"] is None
