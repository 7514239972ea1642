"""The fitted constants (planner/calibration.py) apart from the hardware of conf/cluster/: every
cluster has its calibration, no cluster file holds one, and a `cluster.*` key still replaces it."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from ftcore import planner
from ftcore.config.schema import compose, conf_dir
from ftcore.planner import calibration, userbuffers
from ftcore.planner.memory import GiB
from ftcore.planner.view import view

CLUSTERS = sorted(p.stem for p in (conf_dir() / "cluster").glob("*.yaml"))
FITTED_ONLY = [k for k in calibration.KEYS if k != "nvlink_gbps"]  # NVLink is hardware on GPUs


@pytest.mark.parametrize("name", CLUSTERS)
def test_each_cluster_file_holds_hardware_and_has_a_calibration(name):
    raw = OmegaConf.load(conf_dir() / "cluster" / f"{name}.yaml")
    assert not set(raw) & set(FITTED_ONLY), f"conf/cluster/{name}.yaml holds fitted constants"
    assert name in calibration.CALIBRATIONS
    cfg = compose([f"cluster={name}"])
    assert all(cfg.cluster[k] is None for k in FITTED_ONLY)  # null: the calibration's
    k = calibration.of(cfg.cluster)
    link = cfg.cluster.nvlink_gbps  # the hardware's, on GPU clusters
    fitted = calibration.CALIBRATIONS[name]
    assert k == (fitted if link is None else replace(fitted, nvlink_gbps=link))
    assert 0 < k.matmul_efficiency <= 1 and 0 < k.attention_efficiency <= 1


@pytest.mark.parametrize(
    "key, value", [("matmul_efficiency", 0.31), ("step_overhead_s", 0.5), ("reserve_gib", 9.0)]
)
def test_a_cluster_key_replaces_the_fitted_constant(key, value):
    base = compose(["+exp=70b_fp8"])
    over = compose(["+exp=70b_fp8", f"cluster.{key}={value}"])
    assert getattr(calibration.of(over.cluster), key) == value
    a, b = planner.plan(base), planner.plan(over)
    if key == "reserve_gib":  # beside TE's userbuffers (tp=2 with parallel.tp_comm_overlap)
        ub = userbuffers.buffer_bytes(view(base)) / GiB
        assert ub > 0
        assert a["memory_gib"]["reserve"] == pytest.approx(5.0 + ub)
        assert b["memory_gib"]["reserve"] == pytest.approx(9.0 + ub)
    else:
        assert b["tokens_per_s_per_gpu"] < a["tokens_per_s_per_gpu"]


def test_local_cpu_link_is_the_fitted_one_unless_given():
    cfg = compose(["cluster=local_cpu"])
    assert calibration.of(cfg.cluster).nvlink_gbps == 0.3
    cfg = compose(["cluster=local_cpu", "cluster.nvlink_gbps=2.0"])
    assert calibration.of(cfg.cluster).nvlink_gbps == 2.0


def test_a_cluster_of_ones_own_gets_the_defaults_and_its_own_keys():
    unset = dict.fromkeys(calibration.KEYS)
    mine = SimpleNamespace(name="my_gpu", **{**unset, "matmul_efficiency": 0.4})
    assert calibration.of(mine) == calibration.Calibration(matmul_efficiency=0.4)
