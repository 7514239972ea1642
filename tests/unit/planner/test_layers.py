"""split_layers against megatron-core's own get_num_layers_to_build / get_transformer_layer_offset."""

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from ftcore.errors import FtcoreError
from ftcore.planner.layers import split_layers

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
