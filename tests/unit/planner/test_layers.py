"""split_layers against megatron-core's own get_num_layers_to_build / get_transformer_layer_offset."""

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from ftcore.errors import FtcoreError
from ftcore.planner.layers import first_stage_rule, split_layers

CASES = [
    (4, 1, 1),
    (4, 2, 1),
    (4, 4, 1),
    (4, 2, 2),
    (6, 4, 1),
    (80, 4, 20),
    (80, 4, 5),
    (126, 8, 8),
    (126, 16, 1),
    (30, 4, 2),
    (14, 4, 4),
    (32, 2, 1),
    (2, 4, 1),
]


def _megatron(num_layers, pp, vp, flags):
    cfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        pipeline_dtype=torch.float32,
        **flags,
    )
    vps = list(range(vp)) if vp > 1 else [None]
    layers = [[get_num_layers_to_build(cfg, vp_stage=v, pp_rank=r) for v in vps] for r in range(pp)]
    offs = [
        [get_transformer_layer_offset(cfg, vp_stage=v, pp_rank=r) for v in vps] for r in range(pp)
    ]
    return layers, offs


@pytest.mark.parametrize("num_layers,pp,vp", CASES)
def test_split_matches_megatron(num_layers, pp, vp):
    split = split_layers(num_layers, pp, vp)
    assert sum(split.per_rank()) == num_layers
    layers, offs = _megatron(num_layers, pp, vp, split.megatron_flags())
    assert [list(r) for r in split] == layers
    if pp > 1:
        assert split.offsets == offs


def test_uneven_flags_405b():
    split = split_layers(126, 8, 8)
    assert split.account_for_embedding and split.account_for_loss
    assert split[0][0] == 1 and split[7][7] == 1 and split[3][4] == 2


@pytest.mark.parametrize("num_layers,pp,vp", [(5, 2, 1), (80, 3, 1), (126, 4, 5), (4, 1, 2)])
def test_no_split_names_fields(num_layers, pp, vp):
    with pytest.raises(FtcoreError) as e:
        split_layers(num_layers, pp, vp)
    msg = str(e.value)
    assert "parallel.vp" in msg and ("model.num_layers" in msg or vp > 1 and pp == 1)
    if not (vp > 1 and pp == 1):
        assert "parallel.pp" in msg


def _megatron_or_error(num_layers, pp, vp, first, last):
    """Megatron's layers and offsets for the chosen stages, or None where it refuses them (its
    TransformerConfig check or its layer-count assertion) or would build a negative count of
    layers (first + last > num_layers with stages between passes its checks: -1 % 1 == 0)."""
    flags = dict(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    try:
        layers, offs = _megatron(num_layers, pp, vp, flags)
    except (ValueError, AssertionError):
        return None
    return None if min(min(r) for r in layers) < 0 else (layers, offs)


CHOSEN = [
    (n, pp, vp, first, last)
    for n, pp, vp in [(4, 2, 1), (5, 3, 1), (7, 4, 1), (8, 2, 2), (10, 3, 2)]
    for first in (None, -1, 0, 1, 2, 3, n - 1, n)
    for last in (None, 0, 1, 2, 4, n)
    if first is not None or last is not None
]


def test_chosen_stages_accept_and_build_what_megatron_does():
    """Every count megatron accepts, split_layers gives its layers and offsets; every count
    megatron refuses (or would assert on while building), an FtcoreError naming the key."""
    accepted = 0
    for n, pp, vp, first, last in CHOSEN:
        want = _megatron_or_error(n, pp, vp, first, last)
        if want is None or min(first or 1, last or 1) < 1:
            with pytest.raises(FtcoreError) as e:
                split_layers(n, pp, vp, first=first, last=last)
            assert "parallel.pp_first_stage_layers" in str(e.value) or (
                "parallel.pp_last_stage_layers" in str(e.value)
            ), (n, pp, vp, first, last)
            continue
        split = split_layers(n, pp, vp, first=first, last=last)
        assert ([list(r) for r in split], split.offsets) == want, (n, pp, vp, first, last)
        assert sum(split.per_rank()) == n
        accepted += 1
    assert accepted >= 15, accepted  # the grid holds enough working splits to mean something


def test_deepseek_v3_61_layers_over_4_stages():
    split = split_layers(61, 4, first=13)
    assert split.per_rank() == [13, 16, 16, 16] and split.offsets == [[0], [13], [29], [45]]
    assert split.megatron_flags()["num_layers_in_first_pipeline_stage"] == 13
    assert ([list(r) for r in split], split.offsets) == _megatron_or_error(61, 4, 1, 13, None)


@pytest.mark.parametrize(
    "num_layers,pp,vp,want", [(61, 4, 1, 13), (61, 8, 1, 5), (46, 4, 1, 10), (61, 4, 2, None)]
)
def test_first_stage_rule(num_layers, pp, vp, want):
    """The planner's rule: the smallest largest stage, the first stage smaller on a tie."""
    assert first_stage_rule(num_layers, pp, vp) == want
    if want is not None:
        assert sum(split_layers(num_layers, pp, vp, first=want).per_rank()) == num_layers


def test_chosen_stages_need_pp():
    with pytest.raises(FtcoreError, match="parallel.pp>1"):
        split_layers(4, 1, first=2)


def test_no_split_suggests_the_first_stage_key():
    with pytest.raises(FtcoreError, match="pp_first_stage_layers=13"):
        split_layers(61, 4)
