"""Adapters in and out in Hugging Face PEFT format, and merging them into a base model.

PEFT's file format: `adapter_config.json` (LoraConfig) + `adapter_model.safetensors` with keys
`base_model.model.model.layers.<i>.<self_attn|mlp>.<hf module>.lora_<A|B>.weight` holding full
(unsharded) tensors. A shared A (megatron target names) is written once per slice it serves.
Merging happens on full tensors in fp32 (W + scale·B·A), so it is the same at any TP.
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

from ftcore.errors import FtcoreError
from ftcore.models.sharding import iter_params, join_shards, shard_info, take_shard
from ftcore.peft.layers import COLUMN, SLICES, Geometry, fuse_column, scaling
from ftcore.runtime import dist as rdist

log = logging.getLogger("ftcore")

HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
_OURS = re.compile(
    r"^decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.(linear_\w+)\.lora_([AB])\.(\w+)$"
)
_PEFT = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"


def hf_key(layer: int, hf_module: str, ab: str) -> str:
    return (
        f"base_model.model.model.layers.{layer}.{HF_PARENT[hf_module]}.{hf_module}.lora_{ab}.weight"
    )


def gather_full(chunks, *, everywhere: bool = False) -> dict[str, torch.Tensor] | None:
    """Full adapter tensors by global name, on world rank 0 (None elsewhere) or, with
    `everywhere`, on every rank. Collective: every TP shard is gathered (not only TP rank 0's),
    and every pipeline stage contributes its layers."""
    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    lead = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    mine = {}
    for name, p in iter_params(chunks):
        if ".lora_" not in name:
            continue
        data = p.detach().to(rdist.comm_device(), torch.float32).contiguous()
        shards = [data]
        if tp > 1:
            shards = [torch.empty_like(data) for _ in range(tp)]
            dist.all_gather(shards, data, group=group)
        if lead:
            mine[name] = join_shards(shards, shard_info(name, p, tp)).cpu()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    if everywhere:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    else:
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if dist.get_rank() != 0:
            return None
    out = {}
    for part in parts:
        out.update(part)
    return out


def to_peft(full: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our global names -> PEFT keys; returns (state dict, HF target modules in canonical order)."""
    a_of: dict[tuple[int, str], torch.Tensor] = {}
    b_of: dict[tuple[int, str], torch.Tensor] = {}
    for name, t in full.items():
        m = _OURS.match(name)
        if m is None:
            raise ValueError(f"not an adapter tensor: {name}")
        layer, module, ab, key = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if ab == "A":
            for s in SLICES[module] if key == module else (key,):
                a_of[(layer, s)] = t
        else:
            b_of[(layer, key)] = t
    sd, targets = {}, set()
    for (layer, s), b in b_of.items():
        sd[hf_key(layer, s, "A")] = a_of[(layer, s)].contiguous().clone()
        sd[hf_key(layer, s, "B")] = b.contiguous()
        targets.add(s)
    order = [s for slices in SLICES.values() for s in slices]
    return sd, sorted(targets, key=order.index)


def lora_config(settings, targets: list[str], base: str | None):
    from peft import LoraConfig

    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=targets, use_rslora=settings.rslora, bias="none",
                      task_type="CAUSAL_LM", base_model_name_or_path=base)  # fmt: skip


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
    from ftcore.hf.io import weights_source

    if not (cfg.model.hf_path or cfg.model.init_path):
        return None
    path, _ = weights_source(cfg)
    return str(path.resolve()) if path.is_dir() else str(cfg.model.hf_path)


def save_adapter(
    out_dir: Path, sd: dict[str, torch.Tensor], settings, targets: list[str], base
) -> None:
    """Write a PEFT adapter directory atomically (a temporary name, then rename)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(sd, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
    lora_config(settings, targets, base).save_pretrained(str(tmp))
    with_umask(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def write_hf_adapter(state) -> Path | None:
    """End of a LoRA run: `<run.dir>/hf_adapter/` in PEFT format (every rank calls this)."""
    from ftcore.peft.lora import settings

    cfg = state.cfg
    s = settings(cfg)
    full = gather_full(state.model)
    if full is None:
        return None
    out = Path(state.run_dir) / "hf_adapter"
    sd, targets = to_peft(full)
    save_adapter(out, sd, s, targets, base_reference(cfg))
    log.info("wrote the adapter (%d tensors, PEFT format) to %s", len(sd), out)
    return out


def read_adapter(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config, state dict) of a PEFT directory (safetensors, or a legacy .bin)."""
    from ftcore.peft.lora import read_adapter_config

    path = Path(path)
    config = read_adapter_config(str(path))
    if (path / ADAPTER_FILE).is_file():
        from safetensors.torch import load_file

        return config, load_file(str(path / ADAPTER_FILE))
    if (path / "adapter_model.bin").is_file():
        return config, torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise FtcoreError(f"{path} has no {ADAPTER_FILE}", field="peft.adapter_path",
                      fix="point peft.adapter_path at a PEFT adapter directory")  # fmt: skip


def by_module(sd: dict[str, torch.Tensor], field: str) -> dict[tuple[int, str, str], torch.Tensor]:
    """{(layer, hf module, A|B): tensor}; refuses what ftcore cannot load."""
    out = {}
    for k, t in sd.items():
        m = _PEFT.search(k)
        if m is None or m.group(3) not in HF_PARENT:
            raise FtcoreError(f"the adapter holds {k}, which ftcore cannot load (only LoRA on "
                              f"{', '.join(HF_PARENT)})", field=field)  # fmt: skip
        out[(int(m.group(1)), m.group(3), m.group(4))] = t
    return out


@torch.no_grad()
def load_hf_adapter(chunks, settings, cfg) -> None:
    """Copy a PEFT adapter's tensors into this rank's adapter shards; any mismatch with the base
    (layers, shapes, missing modules) is an FtcoreError."""
    field = "peft.adapter_path"
    _, sd = read_adapter(settings.adapter_path)
    tensors = by_module(sd, field)
    layers = {k[0] for k in tensors}
    if layers and max(layers) >= cfg.model.num_layers:
        raise FtcoreError(
            f"the adapter has layers up to {max(layers)} but the model has {cfg.model.num_layers}: "
            "it was trained on another base", field=field, fix="use the adapter with its own base model",
        )  # fmt: skip
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, p in iter_params(chunks):
        m = _OURS.match(name)
        if m is None:
            continue
        layer, ab, key = int(m.group(1)), m.group(3), m.group(4)
        full = tensors.get((layer, key, ab))
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


# ---------------------------------------------------------------- merge


def hf_base_key(layer: int, hf_module: str) -> str:
    return f"model.layers.{layer}.{HF_PARENT[hf_module]}.{hf_module}.weight"


def merge_deltas(
    adapter_config: dict, sd: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{HF base weight key: (A, B, scale)} of an adapter."""
    scale = scaling(int(adapter_config["r"]), float(adapter_config["lora_alpha"]),
                    bool(adapter_config.get("use_rslora", False)))  # fmt: skip
    t = by_module(sd, "export.merge")
    return {hf_base_key(layer, mod): (t[(layer, mod, "A")], t[(layer, mod, "B")], scale)
            for (layer, mod, ab) in t if ab == "A"}  # fmt: skip


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
    from safetensors.torch import load_file, save_file

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    adapter_config, sd = read_adapter(adapter_dir)
    deltas = merge_deltas(adapter_config, sd)
    shards = sorted(base_dir.glob("*.safetensors"))
    if not shards:
        raise FtcoreError(f"{base_dir} has no safetensors weights", field="model.hf_path")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    done = set()
    for f in shards:
        weights = load_file(str(f))
        done |= set(deltas) & set(weights)
        save_file(merge_state(weights, deltas), str(tmp / f.name), metadata={"format": "pt"})
    missing = set(deltas) - done
    if missing:
        raise FtcoreError(f"the base has no {sorted(missing)[0]} (and {len(missing) - 1} more): the "
                          "adapter was trained on another base", field="export.merge")  # fmt: skip
    for f in base_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not (tmp / f.name).exists():
            shutil.copy2(f, tmp / f.name)
    with_umask(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    log.info("merged %d adapter modules into %s", len(deltas), out_dir)
    return out_dir


def check_adapter_fits(adapter_dir, model_cfg) -> None:
    """Refuse an adapter whose tensors do not fit the model (another base) before anything is built."""
    config, sd = read_adapter(adapter_dir)
    geo, r = geometry(model_cfg), int(config["r"])
    for (layer, mod, ab), t in by_module(sd, "peft.adapter_path").items():
        out, inp = geo.out_in(mod)
        want = (r, inp) if ab == "A" else (out, r)
        if layer >= model_cfg.num_layers or tuple(t.shape) != want:
            raise FtcoreError(
                f"{adapter_dir}: layers.{layer}.{mod}.lora_{ab} has shape {tuple(t.shape)}, this model "
                f"({model_cfg.num_layers} layers) needs {want if layer < model_cfg.num_layers else 'no such layer'}: "
                "the adapter was trained on another base",
                field="peft.adapter_path", fix="use the adapter with the base model it was trained on",
            )  # fmt: skip


# ---------------------------------------------------------------- merge in megatron layout


def geometry(model_cfg) -> Geometry:
    m = model_cfg
    return Geometry(m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
                    m.kv_channels or m.hidden_size // m.num_attention_heads)  # fmt: skip


def megatron_deltas(
    full: dict[str, torch.Tensor], geo: Geometry, scale: float
) -> dict[str, torch.Tensor]:
    """{global base weight name: scale·B·A in megatron's fused layout (fp32)} from full adapters."""
    groups: dict[tuple[int, str, str], dict[str, dict[str, torch.Tensor]]] = {}
    for name, t in full.items():
        m = _OURS.match(name)
        layer, module, ab, key = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        parent = "self_attention" if module in ("linear_qkv", "linear_proj") else "mlp"
        groups.setdefault((layer, parent, module), {"A": {}, "B": {}})[ab][key] = t.float()
    out = {}
    for (layer, parent, module), ab in groups.items():
        per = {s: b @ ab["A"].get(s, ab["A"].get(module)) for s, b in ab["B"].items()}
        if module in COLUMN:
            delta = fuse_column(module, {s: d.t() for s, d in per.items()}, geo, 1).t()
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
    from ftcore.peft.lora import settings

    full = gather_full(state.model, everywhere=True)
    return transform_for(full, geometry(state.cfg.model), settings(state.cfg).scale)


def adapter_names(run_cfg) -> list[str]:
    """Global names of every adapter tensor of a run (from its config)."""
    from ftcore.peft.lora import PARENT, plan_targets, settings

    names = []
    for i in range(run_cfg.model.num_layers):
        for module, slices in plan_targets(settings(run_cfg).targets).items():
            pre = f"decoder.layers.{i}.{PARENT[module]}.{module}."
            names += [pre + f"lora_A.{k}" for k in dict.fromkeys(slices.values())]
            names += [pre + f"lora_B.{s}" for s in slices]
    return names


def read_checkpoint_adapters(step_dir, run_cfg) -> dict[str, torch.Tensor]:
    """Full adapter tensors out of a checkpoint of any layout (one process)."""
    from ftcore.hf.ckpt_reader import CheckpointReader

    reader = CheckpointReader(step_dir)
    names = adapter_names(run_cfg)
    missing = [n for n in names if not reader.has(n)]
    if missing:
        raise FtcoreError(f"{step_dir} lacks adapter tensor {missing[0]} (and {len(missing) - 1} more)",
                          field="export.checkpoint", fix="export a checkpoint of a LoRA run")  # fmt: skip
    return {n: reader.read(n).float() for n in names}


def merge_transform(cfg, run_cfg, step_dir):
    """ftcore.export's hook (export.merge=true): fold the checkpoint's adapters into the base."""
    from ftcore.peft.lora import settings
    from ftcore.precision.recipes import check_merge

    if run_cfg.peft.name == "none":
        raise FtcoreError("the checkpoint has no adapters to merge (a full fine-tuning run)",
                          field="export.merge", fix="drop export.merge=true")  # fmt: skip
    check_merge(run_cfg)
    full = read_checkpoint_adapters(step_dir, run_cfg)
    return transform_for(full, geometry(run_cfg.model), settings(run_cfg).scale)


def export_adapter_checkpoint(step_dir, run_cfg, out, *, merge: bool) -> Path:
    """An adapter-only (LoRA) checkpoint -> `hf_adapter/` (PEFT), or with `merge` a merged HF model
    streamed from the run's base directory (model.hf_path or model.init_path)."""
    from ftcore.peft.lora import settings

    s = settings(run_cfg)
    sd, targets = to_peft(read_checkpoint_adapters(step_dir, run_cfg))
    base = run_cfg.model.hf_path or run_cfg.model.init_path
    if not merge:
        save_adapter(Path(out), sd, s, targets, base)
        return Path(out)
    from ftcore.hf.io import weights_source
    from ftcore.precision.recipes import check_merge

    check_merge(run_cfg)
    if not base:
        raise FtcoreError("merging needs the base weights, but the run had no model.hf_path or "
                          "model.init_path", field="export.merge", fix="export the adapter alone")  # fmt: skip
    base_dir, _ = weights_source(run_cfg)
    tmp = Path(out).with_name(Path(out).name + ".adapter")
    save_adapter(tmp, sd, s, targets, base)
    try:
        return write_merged_model(base_dir, tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
