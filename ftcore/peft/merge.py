"""Merging adapters into their base (W + scale·B·A), and exporting a LoRA run's checkpoint.

Merging happens on full tensors in fp32, so it is the same at any TP: in Hugging Face layout, one
safetensors shard of the base at a time (`write_merged_model`), or in megatron's fused layout as a
transform for ftcore.hf.export (`transform_for`).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ftcore.errors import FtcoreError
from ftcore.hf.ckpt_reader import CheckpointReader
from ftcore.hf.io import weights_source
from ftcore.peft import moe_format
from ftcore.peft.adapter_format import (
    OUR_KEY,
    gather_full,
    read_adapter,
    save_adapter,
    to_peft,
    with_umask,
)
from ftcore.peft.config import (
    COLUMN,
    HF_PARENT,
    PARENT,
    Geometry,
    by_module,
    geometry,
    plan_targets,
    scaling,
    settings,
)
from ftcore.peft.layers import fuse_column
from ftcore.precision.recipes import check_merge
from ftcore.runtime import safe_files

log = logging.getLogger("ftcore")


# ---------------------------------------------------------------- merge in Hugging Face layout


def hf_base_key(layer: int, hf_module: str) -> str:
    return f"model.layers.{layer}.{HF_PARENT[hf_module]}.{hf_module}.weight"


def merge_deltas(
    adapter_config: dict, sd: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{HF base weight key: (A, B, scale)} of an adapter."""
    scale = scaling(int(adapter_config["r"]), float(adapter_config["lora_alpha"]),
                    bool(adapter_config.get("use_rslora", False)))  # fmt: skip
    t = by_module(sd, "export.merge")
    out = {hf_base_key(layer, mod): (t[(layer, mod, "A")], t[(layer, mod, "B")], scale)
           for (layer, mod, ab) in t if ab == "A" and mod != "gate"}  # fmt: skip
    for k, a in sd.items():  # a MoE's experts and router: the base key is the adapter's own
        if k.endswith(".lora_A.weight") and (moe_format.is_expert_key(k) or ".gate.lora_A" in k):
            base = k.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
            out[base] = (a, sd[k.replace(".lora_A.", ".lora_B.")], scale)
    return out


def merge_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale·B·A computed in fp32, cast back to W's dtype."""
    return (w.float() + scale * (b.float() @ a.float())).to(w.dtype)


def merge_state(weights: dict[str, torch.Tensor], deltas: dict) -> dict[str, torch.Tensor]:
    """Merge the adapter into the base tensors of one shard file (keys not in it pass through)."""
    for k, (a, b, scale) in deltas.items():
        if k in weights:
            weights[k] = merge_weight(weights[k], a, b, scale)
    return weights


def write_merged_model(base_dir, adapter_dir, out_dir) -> Path:
    """base HF directory + PEFT adapter -> merged HF directory, one safetensors shard at a time.
    Config, index, tokenizer and other small files are copied unchanged."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    config = base_dir / "config.json"
    if config.is_file() and safe_files.read_json_object(config, "model.hf_path", root=base_dir).get(
        "quantization_config"
    ):
        raise FtcoreError(f"{base_dir} is a quantized (FP8) checkpoint: merging onto its files "
                          "would add the adapter to quantized values", field="export.merge",
                          fix="merge from the live run (its export reads the dequantized base: "
                          "hf_model/ of a LoRA run), or onto a bf16 copy of the base")  # fmt: skip
    adapter_config, sd = read_adapter(adapter_dir)
    deltas = merge_deltas(adapter_config, sd)
    shards = safe_files.entries(base_dir, "model.hf_path", "*.safetensors")
    if not shards:
        raise FtcoreError(f"{base_dir} has no safetensors weights", field="model.hf_path",
                          fix="model.hf_path=DIR holding the base's *.safetensors")  # fmt: skip
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    done = set()
    for f in shards:
        weights = safe_files.load_safetensors(f, "model.hf_path", root=base_dir)
        done |= set(deltas) & set(weights)
        save_file(merge_state(weights, deltas), str(tmp / f.name), metadata={"format": "pt"})
    missing = set(deltas) - done
    if missing:
        raise FtcoreError(f"the base has no {sorted(missing)[0]} (and {len(missing) - 1} more): the "
                          "adapter was trained on another base", field="export.merge",
                          fix="model.hf_path=<the base the adapter was trained on>")  # fmt: skip
    for f in safe_files.entries(base_dir, "model.hf_path"):  # never a link out of the base
        if f.suffix != ".safetensors" and not (tmp / f.name).exists():
            safe_files.copy_file(f, tmp / f.name, "model.hf_path", root=base_dir)
    safe_files.mark_export(tmp, "merged model")
    with_umask(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    log.info("merged %d adapter modules into %s", len(deltas), out_dir)
    return out_dir


# ---------------------------------------------------------------- merge in megatron layout


def megatron_deltas(
    full: dict[str, torch.Tensor], geo: Geometry, scale: float
) -> dict[str, torch.Tensor]:
    """{global base weight name: scale·B·A in megatron's fused layout (fp32)} from full adapters."""
    groups: dict[tuple[int, str, str], dict[str, dict[str, torch.Tensor]]] = {}
    for name, t in full.items():
        e = moe_format.OUR_EXPERT_KEY.match(name)
        if e is not None:  # parent: the expert, by its global index
            parent = f"mlp.experts.local_experts.{e[2]}"
            groups.setdefault((int(e[1]), parent, e[3]), {"A": {}, "B": {}})[e[4]][e[5]] = t.float()
            continue
        m = OUR_KEY.match(name)
        layer, module, ab, key = int(m[1]), m[3], m[4], m[5]
        parent = PARENT[module] + (".shared_experts" if m[2] else "")
        groups.setdefault((layer, parent, module), {"A": {}, "B": {}})[ab][key] = t.float()
    out = {}
    for (layer, parent, module), ab in groups.items():
        per = {s: b @ ab["A"].get(s, ab["A"].get(module)) for s, b in ab["B"].items()}
        if module in COLUMN:
            g = geo.expert() if ".local_experts." in parent else geo
            g = g.shared() if parent.endswith(".shared_experts") else g
            delta = fuse_column(module, {s: d.t() for s, d in per.items()}, g, 1).t()
        else:
            (delta,) = per.values()
        out[f"decoder.layers.{layer}.{parent}.{module}.weight"] = scale * delta
    return out


def transform_for(full: dict[str, torch.Tensor], geo: Geometry, scale: float):
    """A `transform(global name, full tensor)` for ftcore.hf.export: W + scale·B·A in fp32."""
    deltas = megatron_deltas(full, geo, scale)

    def transform(name: str, w: torch.Tensor) -> torch.Tensor:
        d = deltas.get(name)
        return w if d is None else (w.float() + d).to(w.dtype)

    return transform


def live_merge_transform(state):
    """The merge transform of a live LoRA run (collective: gathers the adapters on every rank)."""
    full = gather_full(state.model, everywhere=True)
    return transform_for(full, geometry(state.cfg.model), settings(state.cfg).scale)


# ---------------------------------------------------------------- a LoRA run's checkpoint


def adapter_names(run_cfg) -> list[str]:
    """Global names of every adapter tensor of a run (from its config)."""
    m = run_cfg.model
    names, experts = [], int(getattr(m, "num_experts", None) or 0)
    dense = set(getattr(m, "moe_dense_layers", None) or [])
    shared = ["mlp.shared_experts"] if m.get("moe_shared_expert_ffn_hidden_size") else []
    for i in range(m.num_layers):
        moe = experts and i not in dense
        for module, slices in plan_targets(settings(run_cfg).targets, m).items():
            if module == "router" and not moe:
                continue
            if moe and module in ("linear_fc1", "linear_fc2"):
                parents = [f"mlp.experts.local_experts.{k}" for k in range(experts)] + shared
            else:
                parents = [PARENT[module]]
            for parent in parents:
                pre = f"decoder.layers.{i}.{parent}.{module}."
                names += [pre + f"lora_A.{k}" for k in dict.fromkeys(slices.values())]
                names += [pre + f"lora_B.{s}" for s in slices]
    return names


def read_checkpoint_adapters(step_dir, run_cfg) -> dict[str, torch.Tensor]:
    """Full adapter tensors out of a checkpoint of any layout (one process)."""
    reader = CheckpointReader(step_dir)
    names = adapter_names(run_cfg)
    missing = [n for n in names if not reader.has(n)]
    if missing:
        raise FtcoreError(f"{step_dir} lacks adapter tensor {missing[0]} (and {len(missing) - 1} more)",
                          field="export.checkpoint", fix="export a checkpoint of a LoRA run")  # fmt: skip
    return {n: reader.read(n).float() for n in names}


def merge_transform(cfg, run_cfg, step_dir):
    """ftcore.export's hook (export.merge=true): fold the checkpoint's adapters into the base."""
    if run_cfg.peft.name == "none":
        raise FtcoreError("the checkpoint has no adapters to merge (a full fine-tuning run)",
                          field="export.merge", fix="drop export.merge=true")  # fmt: skip
    check_merge(run_cfg)
    full = read_checkpoint_adapters(step_dir, run_cfg)
    return transform_for(full, geometry(run_cfg.model), settings(run_cfg).scale)


def export_adapter_checkpoint(step_dir, run_cfg, out, *, merge: bool) -> Path:
    """An adapter-only (LoRA) checkpoint -> `hf_adapter/` (PEFT), or with `merge` a merged HF model
    streamed from the run's base directory (model.hf_path or model.init_path)."""
    s = settings(run_cfg)
    sd, targets = to_peft(read_checkpoint_adapters(step_dir, run_cfg), run_cfg.model.family)
    base = run_cfg.model.hf_path or run_cfg.model.init_path
    if not merge:
        save_adapter(Path(out), sd, s, targets, base, run_cfg.model)
        return Path(out)
    check_merge(run_cfg)
    if not base:
        raise FtcoreError("merging needs the base weights, but the run had no model.hf_path or "
                          "model.init_path", field="export.merge", fix="export the adapter alone")  # fmt: skip
    base_dir, _ = weights_source(run_cfg)
    tmp = Path(out).with_name(Path(out).name + ".adapter")
    save_adapter(tmp, sd, s, targets, base, run_cfg.model)
    try:
        return write_merged_model(base_dir, tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
