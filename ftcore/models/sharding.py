"""Global parameter names and the full-tensor <-> TP-shard mapping, shared by init, HF load and export.

A parameter's *global name* is its name in an unsharded, unpipelined model
(`decoder.layers.<global index>.mlp.linear_fc1.weight`), so it is the same under every layout.
`take_shard` cuts this rank's slice from the full tensor the way megatron lays it out.

A MoE layer's experts are named by their global index (`mlp.experts.local_experts.<expert>.`),
whatever EP rank holds them and whichever module holds them (SequentialMLP's local_experts.<k> on
CPU, TEGroupedMLP's `linear_fc1.weight<k>` on GPU); they are sharded over the expert TP group
(`parallel.etp`), not the attention's (`tp_of`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


@dataclass(frozen=True)
class ShardInfo:
    global_name: str
    full_shape: tuple[int, ...]
    partition_dim: int | None  # None: replicated across TP ranks
    glu: bool  # linear_fc1 with SwiGLU: gate and up halves are sharded separately


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def global_name(local_name: str, chunk: torch.nn.Module) -> str:
    """Strip wrappers (DDP's `module.`, LoRA's `base_layer.`) and replace the stage-local layer index
    by the global one."""
    model = unwrap(chunk)
    # DDP's module. prefixes; LoRA-wrapped bases
    name = re.sub(r"^(?:module\.)+", "", local_name).replace(".base_layer.", ".")
    m = _LAYER.match(name)
    if m:
        layer = model.decoder.layers[int(m.group(1))]
        rest = _expert_name(name[m.end() :], layer)
        name = f"decoder.layers.{layer.layer_number - 1}." + rest
    return name


def _expert_name(rest: str, layer) -> str:
    """A local expert's parameter named by its global expert index (module docstring)."""
    local = _LOCAL_EXPERT.match(rest)
    grouped = None if local else _GROUPED_EXPERT.match(rest)
    if not (local or grouped):
        return rest
    indices = layer.mlp.local_expert_indices
    if local:
        return f"mlp.experts.local_experts.{indices[int(local.group(1))]}.{local.group(2)}"
    return f"mlp.experts.local_experts.{indices[int(grouped.group(2))]}.{grouped.group(1)}.weight"


def is_expert(name: str) -> bool:
    """A routed expert's parameter (sharded over the expert TP group, held by one EP rank)."""
    return ".mlp.experts." in name


def tp_of(name: str) -> tuple[int, int]:
    """(size, rank) of the TP group that shards `name`: the expert TP group for experts."""
    from megatron.core import parallel_state as ps

    if is_expert(name):
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def iter_params(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) for every parameter this rank holds, embedding first."""
    for chunk in chunks:
        for local, p in unwrap(chunk).named_parameters():
            yield global_name(local, chunk), p


BUFFERS = ("expert_bias",)  # buffers that are weights of the checkpoint (the router's bias)


def iter_weights(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """iter_params, then the buffers a Hugging Face checkpoint holds as tensors: each MoE
    router's `expert_bias` (DeepSeek-V3's e_score_correction_bias, never trained by the
    optimizer; moe.expert_bias_update_rate moves it)."""
    yield from iter_params(chunks)
    for chunk in chunks:
        for local, b in unwrap(chunk).named_buffers():
            if b is not None and local.rsplit(".", 1)[-1] in BUFFERS:
                yield global_name(local, chunk), b


def shard_info(name: str, param: torch.Tensor, tp: int) -> ShardInfo:
    shape = tuple(param.shape)
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        return ShardInfo(name, shape, dim, _is_glu(name))
    dim = param.partition_dim
    full = list(shape)
    full[dim] *= tp
    return ShardInfo(name, tuple(full), dim, _is_glu(name))


def _is_glu(name: str) -> bool:
    return ".linear_fc1." in name and "lora" not in name and name.endswith("weight")


def take_shard(full: torch.Tensor, info: ShardInfo, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's slice of the full tensor (megatron layout)."""
    if info.partition_dim is None or tp == 1:
        return full
    if info.glu and info.partition_dim == 0:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[tp_rank], up.chunk(tp, 0)[tp_rank]], dim=0)
    return full.chunk(tp, dim=info.partition_dim)[tp_rank]


def join_shards(shards: list[torch.Tensor], info: ShardInfo) -> torch.Tensor:
    """Inverse of take_shard over all TP ranks."""
    if info.partition_dim is None or len(shards) == 1:
        return shards[0]
    if info.glu and info.partition_dim == 0:
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return torch.cat([torch.cat(gates, 0), torch.cat(ups, 0)], dim=0)
    return torch.cat(shards, dim=info.partition_dim)
