"""The planner counts QLoRA's load-time peak: the NF4 base plus the one full-precision shard the
loader hands to the quantizer (hf/io.py), or the whole full-precision base where the base is drawn
at random and quantized afterwards; the fit check refuses a job that fits training but not loading."""

from __future__ import annotations

import pytest

from ftcore import planner
from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.planner import memory, params

QLORA_405B = ["+exp=405b_lora", "peft=qlora", "precision=bf16"]


def _stage(overrides):
    cfg = compose(overrides)
    return cfg, memory.stage_memory(cfg, cfg.cluster.num_gpus, 0)


def test_loaded_qlora_peaks_at_nf4_base_plus_one_bf16_shard():
    cfg, s = _stage([*QLORA_405B, "model.init_path=some/dir"])
    largest = max(o * i for o, i in params.linear_shapes(cfg.model, cfg.parallel.tp).values())
    assert s.parts["load_shard_in_flight"] == 2 * largest  # bf16 fc1 shard: 0.41 GiB at TP=8
    assert s.parts["load_resident"] == s.parts["frozen_weights"]  # NF4 base + embeddings, norms
    assert s.load == s.parts["load_resident"] + s.parts["load_shard_in_flight"]
    assert s.total == max(s.training, s.load) + s.reserve
    p = planner.plan(cfg)
    assert p["memory_gib"]["load_peak"] == pytest.approx(s.load / memory.GiB)


def test_random_qlora_base_is_built_in_full_precision_first():
    cfg, s = _stage(QLORA_405B)
    linears = sum(
        q.numel for chunk in params.rank_params(cfg, 0) for q in chunk if q.kind == "linear"
    )
    assert s.parts["load_shard_in_flight"] == 2 * linears
    assert s.load > s.training  # 405B at TP=8: ~94 GiB of bf16 linears per rank before NF4


def test_fit_check_refuses_a_job_whose_load_does_not_fit():
    cfg, s = _stage(QLORA_405B)
    # training alone would fit, with plan.headroom's margin kept
    room = (s.training + s.reserve + memory.margin(cfg, s)) / memory.GiB + 1
    with pytest.raises(FtcoreError, match="load peak"):
        planner.check_fit(compose([*QLORA_405B, f"cluster.gpu_mem_gib={room}"]), 8)
    planner.check_fit(compose([*QLORA_405B, "model.init_path=d", f"cluster.gpu_mem_gib={room}"]), 8)


def test_lora_load_peak_never_exceeds_training():
    for exp in (["+exp=70b_lora", "model.init_path=d"], ["+exp=405b_lora", "model.init_path=d"]):
        _, s = _stage(exp)
        assert 0 < s.load <= s.training
