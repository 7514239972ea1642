"""Adapters in and out in Hugging Face PEFT format.

PEFT's file format: `adapter_config.json` (LoraConfig) + `adapter_model.safetensors` with keys
`base_model.model.model.layers.<i>.<self_attn|mlp>.<hf module>.lora_<A|B>.weight` holding full
(unsharded) tensors. A shared A (megatron target names) is written once per slice it serves.
Ours are `decoder.layers.<i>.<self_attention|mlp>.<linear>.lora_<A|B>.<key>` (peft/layers.py),
sharded over TP: written gathered, read back into each rank's shard.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors.torch import save_file

from ftcore.errors import FtcoreError
from ftcore.hf.io import weights_source
from ftcore.models.sharding import join_shards, shard_info, take_shard
from ftcore.peft import moe_format
from ftcore.peft.adapter_config import write_adapter_config
from ftcore.peft.config import (
    ADAPTER_FILE,
    HF_ORDER,
    HF_PARENT,
    SHARED,
    SLICES,
    LoraSettings,
    adapter_file,
    by_module,
    read_adapter_config,
    settings,
)
from ftcore.peft.experts import adapter_params, shard_group_of
from ftcore.runtime import collectives, safe_files
from ftcore.runtime import dist as rdist

log = logging.getLogger("ftcore")

# one of our adapter tensors: (layer, shared experts' prefix or None, megatron linear, A|B, key)
OUR_KEY = re.compile(
    r"^decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.(shared_experts\.)?(linear_\w+|router)"
    r"\.lora_([AB])\.(\w+)$"
)


def hf_key(layer: int, hf_module: str, ab: str, family: str = "llama") -> str:
    if hf_module == "gate":  # a MoE router: Mixtral's sits in block_sparse_moe
        return moe_format.hf_router_key(family, layer, ab)
    return (
        f"base_model.model.model.layers.{layer}.{HF_PARENT[hf_module]}.{hf_module}.lora_{ab}.weight"
    )


def gather_full(chunks, *, everywhere: bool = False) -> dict[str, torch.Tensor] | None:
    """Full adapter tensors by global name, on world rank 0 (None elsewhere) or, with
    `everywhere`, on every rank. Collective: every TP shard is gathered (not only TP rank 0's),
    and every pipeline stage contributes its layers."""
    dense_lead = (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    mine = {}
    for name, p in adapter_params(chunks):
        tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
        lead = dense_lead
        if hasattr(p, "shard_tp"):  # an expert's: sharded over etp, replicated over expert DP
            tp, group = p.shard_tp, p.shard_group
            lead = p.shard_group.rank() == 0 and ps.get_expert_data_parallel_rank() == 0
        data = p.detach().to(rdist.comm_device(), torch.float32).contiguous()
        shards = [data]
        if tp > 1:
            shards = [torch.empty_like(data) for _ in range(tp)]
            collectives.all_gather(shards, data, group=group)
        if lead:
            mine[name] = join_shards(shards, shard_info(name, p, tp)).cpu()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    if everywhere:
        parts = [None] * dist.get_world_size()
        collectives.all_gather_object(parts, mine)
    else:
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        collectives.gather_object(mine, parts, dst=0)
        if dist.get_rank() != 0:
            return None
    out = {}
    for part in parts:
        out.update(part)
    return out


def to_peft(
    full: dict[str, torch.Tensor], family: str = "llama"
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our global names -> PEFT keys; returns (state dict, HF target modules in canonical order).
    Experts' adapters take the family's per-expert keys (peft/moe_format.py)."""
    a_of: dict[tuple[int, str], torch.Tensor] = {}
    b_of: dict[tuple[int, str], torch.Tensor] = {}
    sd, targets = {}, set()
    for name, t in full.items():
        e = moe_format.OUR_EXPERT_KEY.match(name)
        if e is not None:
            layer, k, module, ab, key = int(e[1]), int(e[2]), e[3], e[4], e[5]
            slices = SLICES[module] if key == module else (key,)
            for s in slices if ab == "A" else (key,):
                sd[moe_format.hf_expert_key(family, layer, k, s, ab)] = t.contiguous().clone()
                targets.add(s)
            continue
        m = OUR_KEY.match(name)
        if m is None:
            raise ValueError(f"not an adapter tensor: {name}")
        layer, pre, module, ab, key = int(m[1]), m[2] or "", m[3], m[4], m[5]
        if ab == "A":  # a shared expert's slices: "shared_experts.gate_proj" (HF_PARENT)
            for s in SLICES[module] if key == module else (key,):
                a_of[(layer, pre + s)] = t
        else:
            b_of[(layer, pre + key)] = t
    for (layer, s), b in b_of.items():
        sd[hf_key(layer, s, "A", family)] = a_of[(layer, s)].contiguous().clone()
        sd[hf_key(layer, s, "B", family)] = b.contiguous()
        targets.add(s.removeprefix(SHARED))
    return sd, sorted(targets, key=HF_ORDER.index)


def with_umask(root: Path) -> None:
    """safetensors writes its files 0600 (a private temporary file, renamed into place): give
    them the mode every other file gets under the user's umask, so a shared run directory stays
    readable by those it is shared with."""
    mask = os.umask(0)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    for f in root.rglob("*"):
        if f.is_file():
            f.chmod(0o666 & ~mask)


def base_reference(cfg) -> str | None:
    """The base that adapter_config.json names: the absolute path of the weights' directory (a
    bare folder name would send PEFT to the Hub), or model.hf_path as given when it is not a
    directory here (a Hub name)."""
    if not (cfg.model.hf_path or cfg.model.init_path):
        return None
    path, _ = weights_source(cfg)
    return str(path.resolve()) if path.is_dir() else str(cfg.model.hf_path)


def save_adapter(
    out_dir: Path,
    sd: dict[str, torch.Tensor],
    s: LoraSettings,
    targets: list[str],
    base,
    model_cfg=None,
) -> None:
    """Write a PEFT adapter directory atomically (a temporary name, then rename); `model_cfg` of a
    mixture of experts names the targets as PEFT needs them there (peft/moe_format.py)."""
    params = None
    if model_cfg is not None and moe_format.is_moe(model_cfg):
        targets, params = moe_format.peft_targets(
            model_cfg.family, targets, list(model_cfg.moe_dense_layers),
            bool(model_cfg.get("moe_shared_expert_ffn_hidden_size")),
        )  # fmt: skip
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(sd, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
    write_adapter_config(tmp, s, targets, base, params)  # PEFT's file, without importing peft
    safe_files.mark_export(tmp, "hf_adapter")  # what export.overwrite may replace
    with_umask(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def write_hf_adapter(state) -> Path | None:
    """End of a LoRA run: `<run.dir>/hf_adapter/` in PEFT format (every rank calls this)."""
    cfg = state.cfg
    s = settings(cfg)
    full = gather_full(state.model)
    if full is None:
        return None
    out = Path(state.run_dir) / "hf_adapter"
    sd, targets = to_peft(full, cfg.model.family)
    save_adapter(out, sd, s, targets, base_reference(cfg), cfg.model)
    log.info("wrote the adapter (%d tensors, PEFT format) to %s", len(sd), out)
    if moe_format.is_moe(cfg.model) and {"gate_proj", "up_proj"} <= set(targets):
        log.info("PEFT 0.21 prints 'rank_pattern (alpha_pattern) keys did not match any targeted "
                 "module and were ignored: .*\\.gate_up_proj' loading it onto transformers 5: they "
                 "are PEFT's own keys for the fused experts, and applied (its check looks at "
                 "modules, not parameters; its own MoE adapters print the same: docs/moe.md)")  # fmt: skip
    return out


def read_adapter(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config, state dict) of a PEFT directory (safetensors, or a legacy .bin)."""
    config = read_adapter_config(str(path))
    f = adapter_file(path)
    if f.name == ADAPTER_FILE:
        return config, safe_files.load_safetensors(f, "peft.adapter_path", root=f.parent)
    sd = safe_files.torch_load(f, "peft.adapter_path", root=f.parent)
    if not isinstance(sd, dict) or not all(isinstance(t, torch.Tensor) for t in sd.values()):
        raise FtcoreError(f"{f} holds no tensors by name", field="peft.adapter_path",
                          fix="a PEFT adapter directory")  # fmt: skip
    return config, sd


@torch.no_grad()
def load_hf_adapter(chunks, s: LoraSettings, cfg) -> None:
    """Copy a PEFT adapter's tensors into this rank's adapter shards; any mismatch with the base
    (layers, shapes, missing modules) is an FtcoreError."""
    field = "peft.adapter_path"
    _, sd = read_adapter(s.adapter_path)
    tensors = by_module(sd, field)
    layers = {k[0] for k in tensors}
    if layers and max(layers) >= cfg.model.num_layers:
        raise FtcoreError(
            f"the adapter has layers up to {max(layers)} but the model has {cfg.model.num_layers}: "
            "it was trained on another base", field=field, fix="use the adapter with its own base model",
        )  # fmt: skip
    experts = moe_format.by_expert(sd, field)
    for name, p in adapter_params(chunks):
        tp, tp_rank = shard_group_of(p)
        e, m = moe_format.OUR_EXPERT_KEY.match(name), OUR_KEY.match(name)
        if e is not None:
            layer, ab, key = int(e[1]), e[4], e[5]
            full = experts.get((layer, int(e[2]), key, ab))
        elif m is not None:
            layer, ab, key = int(m[1]), m[4], (m[2] or "") + m[5]
            full = tensors.get((layer, key, ab))
        else:
            continue
        info = shard_info(name, p, tp)
        if full is None:
            raise FtcoreError(f"the adapter has no lora_{ab} for layer {layer} {key}", field=field,
                              fix="use a complete adapter trained on this base")  # fmt: skip
        if tuple(full.shape) != info.full_shape:
            raise FtcoreError(
                f"adapter tensor layers.{layer}.{key}.lora_{ab} has shape {tuple(full.shape)}, this "
                f"model needs {info.full_shape}: the adapter was trained on another base",
                field=field, fix="use the adapter with the base model it was trained on",
            )  # fmt: skip
        p.copy_(take_shard(full.float(), info, tp_rank, tp).to(p.dtype))
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("loaded the adapter %s (peft.adapter_path: %d tensors)", s.adapter_path, len(sd))
