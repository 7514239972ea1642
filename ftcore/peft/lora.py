"""Apply LoRA/QLoRA to this rank's megatron chunks: freeze the base, wrap the target linears, give
the adapters a layout-independent init (or an existing PEFT adapter's weights).

Target names: Hugging Face names (q_proj ... down_proj) put one adapter on exactly that slice of the
fused megatron layer, as PEFT means them; megatron names (linear_qkv, linear_proj, linear_fc1,
linear_fc2) put one adapter with a shared A on the whole fused layer (NeMo's meaning).
"""

from __future__ import annotations

import logging
import math
import zlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from omegaconf import DictConfig

from ftcore.models.nf4 import quantize_linear
from ftcore.models.sharding import iter_params, shard_info, take_shard, unwrap
from ftcore.peft.adapter_format import load_hf_adapter
from ftcore.peft.config import (
    PARENT,
    Geometry,
    LoraSettings,
    check_config,
    plan_targets,
    settings,
)
from ftcore.peft.experts import (
    adapt_router,
    adapter_params,
    is_moe_layer,
    shard_group_of,
    wrap_experts,
)
from ftcore.peft.layers import LoraParallelLinear
from ftcore.peft.te_layers import lora_linear  # the TE variant over TE linears (GPU spec)
from ftcore.runtime import collectives
from ftcore.runtime import dist as rdist

log = logging.getLogger("ftcore")


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) + 7) % (2**63))
    return g


@torch.no_grad()
def init_adapters(chunks, seed: int) -> None:
    """A: PEFT's kaiming-uniform (bound 1/sqrt(full fan-in)) drawn as the full tensor from a
    generator seeded by the global name, then sliced; B: zeros. Identical at any TP/PP.

    The draw is on the CPU (its generator fixes the values; an A is r x in, small) and the shard is
    copied into the parameter where it lives; a parameter on `meta` (a dry build) holds no values."""
    for name, p in adapter_params(chunks):
        if p.is_meta:
            continue  # the planner's dry build: nothing to draw into
        tp, tp_rank = shard_group_of(p)
        if ".lora_A." in name:
            info = shard_info(name, p, tp)
            bound = 1.0 / math.sqrt(info.full_shape[1])
            full = torch.empty(info.full_shape, device="cpu").uniform_(
                -bound, bound, generator=_generator(seed, name)
            )
            p.copy_(take_shard(full, info, tp_rank, tp).to(p.device, p.dtype))
        elif ".lora_B." in name:
            p.zero_()


def _layers(chunks):
    for chunk in chunks:
        yield from unwrap(chunk).decoder.layers


def apply_peft(cfg: DictConfig, chunks: list, *, say: bool = True) -> LoraSettings:
    """Freeze the base, (QLoRA: quantise its linears to NF4), add adapters, init or load them.
    `say`: log the trainable-parameter count (a training run's line; eval and generate train
    nothing)."""
    check_config(cfg)
    s = settings(cfg)
    plan = plan_targets(s.targets, cfg.model)
    config = unwrap(chunks[0]).config
    geo = Geometry.of(config)
    tp = ps.get_tensor_model_parallel_world_size()
    sp = bool(config.sequence_parallel) and tp > 1
    dtype = config.params_dtype  # the adapted layers' own dtype (their device: each base's)
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
    quantize = quantize_linear if cfg.peft.name == "qlora" else None
    for layer in _layers(chunks):
        for module, parent_name in PARENT.items():
            parent = getattr(layer, parent_name)
            if is_moe_layer(parent) or module == "router":
                continue  # the experts and the router: below
            base = getattr(parent, module, None)
            if base is None:
                continue  # the other attention's linears (MLA or q/k/v)
            if quantize is not None:
                base = quantize(base, double_quant=cfg.peft.double_quant, sp=sp)
            if module in plan:
                base = lora_linear(base, module, plan[module], geo=geo, r=s.r, scale=s.scale,
                                   dropout=s.dropout, tp=tp, sp=sp, dtype=dtype)  # fmt: skip
            setattr(parent, module, base)
        if is_moe_layer(layer.mlp):
            experts = {m: plan[m] for m in ("linear_fc1", "linear_fc2") if m in plan}
            wrap_experts(layer.mlp, experts, geo=geo, r=s.r, scale=s.scale, dropout=s.dropout,
                         dtype=dtype)  # fmt: skip
            if "router" in plan:
                adapt_router(layer.mlp.router, geo=geo, r=s.r, scale=s.scale, dtype=dtype, sp=sp)
            shared = getattr(layer.mlp, "shared_experts", None)
            for module in experts if shared is not None else ():  # like a dense MLP of its width
                setattr(shared, module, lora_linear(
                    getattr(shared, module), module, experts[module], geo=geo.shared(), r=s.r,
                    scale=s.scale, dropout=s.dropout, tp=tp, sp=sp, dtype=dtype))  # fmt: skip
    if config.recompute_granularity == "full":
        embedding_output_requires_grad(chunks)
    init_adapters(chunks, cfg.run.seed)
    if s.adapter_path:
        load_hf_adapter(chunks, s, cfg)
    trainable, total = count_params(cfg, chunks)
    if say and (dist.get_rank() == 0 if dist.is_initialized() else True):
        log.info("trainable params: %s || all params: %s || trainable%%: %.4f",
                 f"{trainable:,d}", f"{total:,d}", 100 * trainable / total)  # fmt: skip
    return s


def embedding_output_requires_grad(chunks) -> None:
    """Full recompute runs each layer inside megatron's reentrant checkpoint function, whose output
    needs a gradient only if one of its inputs does. With the embedding frozen, the first stage's
    layers would get none, and neither would their adapters (HF's enable_input_require_grads
    exists for the same reason). Later stages receive tensors that require grad already."""

    def hook(module, args, out):
        if torch.is_grad_enabled() and not out.requires_grad:
            out.requires_grad_(True)

    for chunk in chunks:
        if getattr(unwrap(chunk), "pre_process", False):
            unwrap(chunk).embedding.register_forward_hook(hook)


def _vocab_rows(name: str, p: torch.Tensor, vocab: int) -> int | None:
    """Rows of a vocab-parallel tensor that are real tokens (padding excluded)."""
    if not (name.startswith("embedding.word_embeddings") or name.startswith("output_layer")):
        return None
    local = p.shape[0]
    start = ps.get_tensor_model_parallel_rank() * local
    return max(0, min(vocab, start + local) - start)


def count_params(cfg: DictConfig, chunks: list) -> tuple[int, int]:
    """(trainable, all) parameters of the whole model counted once each, with the real vocab, as
    PEFT's print_trainable_parameters counts them on the Hugging Face model."""
    first_dp = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    tp_rank = ps.get_tensor_model_parallel_rank()
    trainable = total = 0
    vocab = unwrap(chunks[0]).vocab_size_unpadded
    for name, p in iter_params(chunks):
        if ".local_experts." in name:  # once: expert-DP rank 0, etp rank 0 if replicated
            if ps.get_expert_data_parallel_rank() != 0 or (
                not getattr(p, "tensor_model_parallel", False)
                and ps.get_expert_tensor_parallel_rank() != 0
            ):
                continue
        elif not first_dp or (not getattr(p, "tensor_model_parallel", False) and tp_rank != 0):
            continue
        if cfg.model.tie_embeddings and name.startswith("output_layer"):
            continue
        n = getattr(p, "logical_numel", p.numel())
        rows = _vocab_rows(name, p, vocab)
        if rows is not None:
            n = rows * p.shape[1]
        total += n
        trainable += n if p.requires_grad else 0
    t = torch.tensor([trainable, total], dtype=torch.float64, device=rdist.comm_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.all_reduce(t)
    return int(t[0]), int(t[1])


def lora_modules(chunks):
    """(global layer index, megatron module name, LoraParallelLinear) of this rank."""
    for layer in _layers(chunks):
        for module, parent_name in PARENT.items():
            m = getattr(getattr(layer, parent_name), module, None)
            if isinstance(m, LoraParallelLinear):
                yield layer.layer_number - 1, module, m
