"""exp/405b_nvfp4_lora: composes, is a valid NVFP4 config, runs on its cluster's GPUs and passes
the planner's memory-fit check there."""

from __future__ import annotations

import pytest

from ftcore.config.schema import compose, conf_dir
from ftcore.precision import hardware, recipes

pytestmark = pytest.mark.skipif(
    not (conf_dir() / "cluster" / "b200.yaml").exists(), reason="cluster/b200 is not there yet"
)


@pytest.fixture(scope="module")
def cfg():
    return compose(["+exp=405b_nvfp4_lora"])


def test_is_an_nvfp4_lora_run_on_b200(cfg):
    assert (cfg.precision.name, cfg.peft.name, cfg.cluster.name) == ("nvfp4", "lora", "b200")
    recipes.check_config(cfg)
    assert hardware.cluster_supports(cfg) == (True, "")
    kw = recipes.transformer_config_kwargs(cfg)
    assert kw["fp4"] == "e2m1" and kw["fp4_recipe"] == "nvfp4" and kw["fp8"] is None
    assert kw["first_last_layers_bf16"] and kw["num_layers_at_start_in_bf16"] == 1


def test_passes_the_fit_check_on_its_cluster(cfg):
    planner = pytest.importorskip("ftcore.planner")
    planner.check_fit(cfg, cfg.cluster.num_gpus)
