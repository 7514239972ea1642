"""Random initialisation of the base, two ways (`model.init_method`).

layout_independent (tests, small models, every CPU run): each parameter is drawn as the full tensor
on the CPU from a generator seeded by (run.seed, global name), then sliced to this rank's shard.
TP/PP/DP never change it, which is what the layout-parity tests rely on. Its cost is the whole
model drawn on the CPU of every rank: hours for 405B (~2.2 s per 1e8 values on one thread) and
~16 GiB of fp32 transients for its embedding (the real rows and the padded copy).

sharded (large random-init runs on GPU: the benchmarks have no model.hf_path): each rank draws only
its own shard, on the parameter's device, from a generator on that device seeded by (run.seed,
global name, TP shard index). Same distributions (std, scaled std of the output projections, ones,
zero padded vocab rows); no full tensor exists anywhere. NOT layout-independent: another TP size
gives other numbers (a replicated parameter is the same on every rank, and every DP/CP replica of
a shard is the same). The values also depend on the device's generator (same seed, same layout,
same GPU type: same values).

`auto` is sharded on GPU from 1e9 parameters on, layout-independent otherwise
(ftcore.planner.params.init_method, next to the parameter count it reads).
"""

from __future__ import annotations

import math
import zlib

import torch

from ftcore.models.sharding import is_expert, iter_params, shard_info, take_shard, tp_of


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def _std(name: str, std: float, num_layers: int) -> float:
    """megatron's normal init, scaled for the layers that write into the residual stream."""
    if "linear_proj" in name or "linear_fc2" in name:
        return std / math.sqrt(2.0 * num_layers)
    return std


def _constant(name: str) -> float | None:
    """1 for norm weights, 0 for biases, None for drawn parameters."""
    if "norm" in name and name.endswith("weight"):
        return 1.0
    if name.endswith("bias"):
        return 0.0
    return None


def _is_vocab(name: str) -> bool:
    return "word_embeddings" in name or name.startswith("output_layer")


def full_init(
    name: str, shape: tuple[int, ...], *, seed: int, std: float, num_layers: int, vocab_size: int
) -> torch.Tensor:
    """The full fp32 tensor for a parameter, as megatron's normal / scaled-normal init draws it."""
    const = _constant(name)
    if const is not None:
        return torch.full(shape, const, device="cpu")
    std = _std(name, std, num_layers)
    g = _generator(seed, name)
    if _is_vocab(name):
        real = torch.empty((vocab_size,) + tuple(shape[1:]), device="cpu").normal_(
            0.0, std, generator=g
        )
        full = torch.zeros(shape, device="cpu")
        full[:vocab_size] = real  # padded vocab rows stay zero; their logits are masked anyway
        return full
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=g)


@torch.no_grad()
def init_weights(
    chunks, *, seed: int, std: float, num_layers: int, vocab_size: int, tp: int, tp_rank: int
) -> None:
    """Layout-independent: full tensor on the CPU, this rank's slice copied to the parameter."""
    for name, p in iter_params(chunks):
        if p.is_meta:  # a dry build: nothing to draw
            continue
        n, r = tp_of(name) if is_expert(name) else (tp, tp_rank)  # experts: the expert TP group
        info = shard_info(name, p, n)
        full = full_init(
            name, info.full_shape, seed=seed, std=std, num_layers=num_layers, vocab_size=vocab_size
        )
        p.copy_(take_shard(full, info, r, n).to(p.dtype))


def _shard_generator(seed: int, name: str, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(f"{name}#{index}".encode()) + 1) % (2**63))
    return g


@torch.no_grad()
def init_shards(
    chunks, *, seed: int, std: float, num_layers: int, vocab_size: int, tp: int, tp_rank: int
) -> None:
    """Sharded: each rank draws its own shard on the parameter's device (fp32, then cast: an FP8
    parameter quantizes it on copy). A replicated parameter uses shard index 0 on every rank."""
    for name, p in iter_params(chunks):
        if p.is_meta:
            continue
        const = _constant(name)
        if const is not None:
            p.fill_(const)
            continue
        n, r = tp_of(name) if is_expert(name) else (tp, tp_rank)  # experts: the expert TP group
        info = shard_info(name, p, n)
        index = r if info.partition_dim is not None and n > 1 else 0
        g = _shard_generator(seed, name, index, p.device)
        shard = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        shard.normal_(0.0, _std(name, std, num_layers), generator=g)
        if _is_vocab(name):  # rows past the real vocab (megatron's padding) stay zero
            first = index * p.shape[0] if info.partition_dim == 0 else 0
            shard[max(0, vocab_size - first) :] = 0.0
        p.copy_(shard)
