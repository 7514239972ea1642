"""The plan's host memory per rank (`host_gib`): what the init and an async checkpoint stage on the
CPU. No high-precision copy of a frozen FP8 base: the 405B LoRA rank needs a few GiB of host
memory, not the ~100 GB its BF16 shard would take (issue 24, finding 4)."""

from __future__ import annotations

import pytest

from ftcore.config.schema import compose
from ftcore.planner import plan
from ftcore.planner.memory import GiB, host_bytes, model_state
from tests.support.tiny import TINY


def test_405b_fp8_lora_rank_needs_little_host_memory():
    cfg = compose(["+exp=405b_lora"])  # FP8 weights (fp8_param_gather), random base: sharded init
    host = plan(cfg)["host_gib"]
    state = model_state(cfg, 0, 1)
    assert host["init"] == 0.0
    assert host["peak"] * GiB < 0.05 * state["elements"] * 2  # vs a BF16 copy of the rank's base
    assert host["peak"] == max(host["init"], host["checkpoint"])


def test_async_checkpoint_stages_the_saved_state_on_the_host():
    cfg = compose(["+exp=405b_full"])
    world = cfg.cluster.num_gpus
    state = model_state(cfg, 0, world // 128)  # tp 8 x pp 16 = 128: dp 1
    assert host_bytes(cfg, world, 0)["checkpoint"] == state["trainable"] + state["optimizer"]
    cfg.checkpoint.async_save = False
    assert host_bytes(cfg, world, 0)["checkpoint"] == 0
    cfg.cluster.device = "cpu"  # synchronous on CPU
    cfg.checkpoint.async_save = True
    assert host_bytes(cfg, world, 0)["checkpoint"] == 0


@pytest.mark.parametrize(
    ("overrides", "drawn"),
    [
        ([], True),  # layout-independent random init: full tensors on the CPU
        (["model.init_method=sharded"], False),
        (["model.hf_path=/nonexistent"], False),  # a loaded base is not drawn
    ],
)
def test_init_term_follows_the_init_method(overrides, drawn):
    cfg = compose([*TINY, "model.init_path=null", *overrides])
    m = cfg.model
    init = host_bytes(cfg, 1, 0)["init"]
    if not drawn:
        assert init == 0
        return
    # the embedding's real rows and its padded copy (both fp32) outweigh every linear here
    assert init == 4 * 2 * m.vocab_size * m.hidden_size  # the vocab is already a multiple of 128
    assert init >= 4 * 2 * m.ffn_hidden_size * m.hidden_size
