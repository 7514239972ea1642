"""Layout-independent initialisation: each parameter is drawn as the full tensor from a generator
seeded by (run.seed, global name), then sliced to this rank's shard. TP/PP/DP never change it."""

from __future__ import annotations

import math
import zlib

import torch

from ftcore.models.sharding import iter_params, shard_info, take_shard


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def full_init(
    name: str, shape: tuple[int, ...], *, seed: int, std: float, num_layers: int, vocab_size: int
) -> torch.Tensor:
    """The full fp32 tensor for a parameter, as megatron's normal / scaled-normal init draws it."""
    if "norm" in name and name.endswith("weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "linear_proj" in name or "linear_fc2" in name:
        std = std / math.sqrt(2.0 * num_layers)
    g = _generator(seed, name)
    if "word_embeddings" in name or name.startswith("output_layer"):
        real = torch.empty((vocab_size,) + tuple(shape[1:])).normal_(0.0, std, generator=g)
        full = torch.zeros(shape)
        full[:vocab_size] = real  # padded vocab rows stay zero; their logits are masked anyway
        return full
    return torch.empty(shape).normal_(0.0, std, generator=g)


@torch.no_grad()
def init_weights(
    chunks, *, seed: int, std: float, num_layers: int, vocab_size: int, tp: int, tp_rank: int
) -> None:
    for name, p in iter_params(chunks):
        info = shard_info(name, p, tp)
        full = full_init(
            name, info.full_shape, seed=seed, std=std, num_layers=num_layers, vocab_size=vocab_size
        )
        p.copy_(take_shard(full, info, tp_rank, tp).to(p.dtype))
