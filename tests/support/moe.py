"""Tiny random Qwen3-MoE and Mixtral checkpoints built by transformers itself (the oracle), saved
with save_pretrained into a test's temp dir together with the bundled tokenizer.

Four experts, top-2, a few layers; four layers; the Qwen3-MoE one keeps layer 1 dense (`mlp_only_layers`) and
has q/k norms and head_dim != hidden / heads. Weights are drawn with O(1) activations so that a
wrong expert, a wrong gate/up order or a wrong router shows in the logits, and the router is
drawn wide enough that the top-2 choice is not decided by rounding."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.hf_helpers import VOCAB, randomize, save_with_tokenizer

NUM_EXPERTS = 4
TOPK = 2
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def moe_config(family: str = "qwen3_moe", vocab: int = VOCAB, **over):
    """The transformers config of a tiny MoE model of `family` (qwen3_moe or mixtral)."""
    import transformers

    kw = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=2032, eos_token_id=2033,
              num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOPK, router_aux_loss_coef=0.01,
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0})  # fmt: skip
    if family == "qwen3_moe":
        kw.update(head_dim=32, intermediate_size=96, moe_intermediate_size=48, norm_topk_prob=True,
                  mlp_only_layers=[1], decoder_sparse_step=1, attention_bias=False)  # fmt: skip
        cls = transformers.Qwen3MoeConfig
    elif family == "mixtral":
        kw.update(intermediate_size=48, sliding_window=None)
        cls = transformers.MixtralConfig
    else:
        raise ValueError(f"not a MoE family: {family}")
    kw.update(over)
    return cls(**kw)


@torch.no_grad()
def make_tiny_moe(path: str | Path, family: str = "qwen3_moe", *, seed: int = 0,
                  max_shard_size: str = "150KB", **over) -> Path:  # fmt: skip
    """A random `family` model saved in shards (with an index) plus a Llama-3 base tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, **over))
    randomize(model)
    return save_with_tokenizer(model, path, max_shard_size)
