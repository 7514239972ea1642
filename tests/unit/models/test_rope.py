"""RoPE frequencies: ftcore's equal transformers' for default and llama3 scaling with all four
fields; megatron-core's own (hard-coded low/high factors and original length) do not, which is
why ftcore installs its own."""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ftcore.models import rope
from tests.support.hf_helpers import ROPE, hf_config


def _hf_inv_freq(config) -> torch.Tensor:
    rope_type = (
        "llama3"
        if getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        else "default"
    )
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")[0]


def test_llama3_scaling_matches_transformers_exactly():
    config = hf_config(head_dim=32, hidden_size=128)
    ours = rope.inv_freq(32, 5000.0, ROPE)
    assert torch.equal(ours, _hf_inv_freq(config))
    megatron = RotaryEmbedding(32, 1.0, rotary_base=5000, rope_scaling=True, rope_scaling_factor=ROPE["factor"],
                               use_cpu_initialization=True).inv_freq  # fmt: skip
    assert not torch.allclose(megatron, ours), "megatron's defaults would have been right by chance"


def test_default_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    assert torch.equal(rope.inv_freq(16, theta), LlamaRotaryEmbedding(config).inv_freq)
