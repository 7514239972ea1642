"""TE's userbuffers in the plan (ftcore/planner/userbuffers.py): 12 communicators of the layer's
gathered input [seq_len x micro_batch / cp, hidden] per quantization mode, as TE 2.9's
initialize_ub allocates them for what ftcore/runtime/userbuffers.py registers, in the reserve of
every stage."""

from __future__ import annotations

import pytest

from ftcore.config.schema import compose
from ftcore.planner import userbuffers as ub
from ftcore.planner.memory import GiB, all_stages
from ftcore.planner.view import view
from ftcore.runtime import userbuffers as runtime_ub

WORKSPACES = ub.STREAMS * ub.CUBLAS_WORKSPACE


def _cfg(*ov: str):
    return view(compose(["+exp=70b_fp8", *ov]))


@pytest.mark.parametrize(
    "ov, per_token_hidden",
    [
        (["precision=bf16"], 12 * 2),  # twelve bf16 buffers
        ([], 8 * 1 + 4 * 2),  # FP8 mode: the 8 all-gather buffers in uint8, 4 reduce-scatter bf16
        (["precision.first_last_bf16_layers=2"], 8 + 4 * 2 + 12 * 2),  # both modes
    ],
)
def test_twelve_buffers_per_mode_of_the_gathered_layer_input(ov, per_token_hidden):
    cfg = _cfg("parallel.tp_comm_overlap=true", *ov)
    tokens = cfg.data.seq_len * cfg.train.micro_batch_size // cfg.parallel.cp
    assert ub.buffer_bytes(cfg) == tokens * cfg.model.hidden_size * per_token_hidden + WORKSPACES
    # the shape and the modes are the ones the runtime hands TE
    assert runtime_ub.buffer_shape(cfg) == [tokens, cfg.model.hidden_size]
    assert runtime_ub.quantization_modes(cfg) == ub.modes(cfg)


def test_none_without_the_overlap_at_tp_1_or_on_cpu():
    assert ub.buffer_bytes(_cfg("parallel.tp_comm_overlap=false")) == 0
    assert ub.buffer_bytes(_cfg("parallel.tp_comm_overlap=true", "parallel.tp=1")) == 0
    assert ub.buffer_bytes(view(compose(["+exp=tiny_lora", "parallel.tp_comm_overlap=true"]))) == 0


def test_every_stage_reserves_them_and_128k_tokens_take_12_gib():
    """70b_lora_128k (tp=2 with the overlap, cp=2, 131072-token rows): 65536 tokens x 8192 x 2 B x
    12 = 12 GiB per GPU (issue 50, item 10), on top of the calibrated reserve."""
    cfg = view(compose(["+exp=70b_lora_128k"]))
    assert cfg.parallel.tp_comm_overlap and cfg.parallel.tp == 2 and cfg.parallel.cp == 2
    assert ub.buffer_bytes(cfg) == 65536 * 8192 * 2 * 12 + WORKSPACES
    off = view(compose(["+exp=70b_lora_128k", "parallel.tp_comm_overlap=false"]))
    for on_s, off_s in zip(all_stages(cfg, 4), all_stages(off, 4)):
        assert on_s.reserve - off_s.reserve == ub.buffer_bytes(cfg)
        assert on_s.parts["userbuffers"] / GiB == pytest.approx(12.1, abs=0.01)
