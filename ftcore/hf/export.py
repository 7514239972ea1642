"""Write a Hugging Face model directory (safetensors shards + index + config.json + tokenizer),
streaming tensor by tensor: from a live run (`write_hf_model`, every rank) or from a checkpoint
of any layout (`export_checkpoint`, one process).

The file plan (which HF tensor goes into which shard) is computed from the config before any
tensor exists, so each shard's header is written first and each tensor is written at its place
as soon as it is produced, then dropped. Vocab padding is removed; fused megatron tensors are split
back into q/k/v and gate/up. `transform(global_name, full_tensor) -> tensor` is an optional hook
applied to every full megatron tensor before it is mapped (LoRA merge plugs in here).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ftcore.hf import carried, fp8, mappings
from ftcore.hf.config import hf_config_dict
from ftcore.hf.io import INDEX, StreamWriter
from ftcore.models.sharding import is_expert
from ftcore.runtime import safe_files

log = logging.getLogger("ftcore")
Transform = Callable[[str, torch.Tensor], torch.Tensor]
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}  # fmt: skip
DTYPE_JSON = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class ShardFile:
    name: str
    owner: int
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = field(default_factory=list)
    nbytes: int = 0


def _entries(name: str, shape: tuple, dtype: torch.dtype, block) -> list[tuple]:
    """What export writes for one HF tensor: the router's expert bias in fp32 (as transformers
    keeps it), an FP8 weight with its scales (`block`: export.dtype=fp8), else `dtype`."""
    if name.endswith("e_score_correction_bias"):
        return [(name, torch.float32, tuple(shape))]
    return fp8.export_entries(name, shape, dtype, block)


def plan_files(s: mappings.Shapes, dtype: torch.dtype, owner: Callable[[str], int],
               max_bytes: float, extra=(), block=None) -> list[ShardFile]:  # fmt: skip
    """HF tensors in order, cut into files at max_bytes and wherever the writing rank changes;
    then `extra` (name, dtype, shape), written by rank 0 (hf/carried.py: MTP layers). `block`:
    the FP8 block of an FP8 export (an FP8 weight and its scales share a file)."""
    files: list[ShardFile] = []
    planned = [(_entries(n, mappings.hf_shape(n, s), dtype, block), owner(n))
               for n in mappings.hf_names(s)]  # fmt: skip
    for group, who in planned + [([e], 0) for e in extra]:
        n = sum(
            torch.Size(sh).numel() * torch.empty((), dtype=d).element_size() for _, d, sh in group
        )
        if (
            not files
            or files[-1].owner != who
            or (files[-1].entries and files[-1].nbytes + n > max_bytes)
        ):
            files.append(ShardFile("", who))
        files[-1].entries += group
        files[-1].nbytes += n
    for k, f in enumerate(files):
        f.name = (
            "model.safetensors"
            if len(files) == 1
            else f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        )
    return files


def write_index(out: Path, files: list[ShardFile]) -> None:
    if len(files) == 1:
        return
    weight_map = {name: f.name for f in files for name, _, _ in f.entries}
    index = {"metadata": {"total_size": sum(f.nbytes for f in files)}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def write_metadata(out: Path, model_cfg, dtype: torch.dtype, tokenizer_dir: str | None,
                   block=None) -> None:  # fmt: skip
    """config.json (with `block`: an FP8 export's quantization_config), the tokenizer (with its
    chat template) and the source's generation config."""
    tok = None
    if tokenizer_dir:
        from ftcore.data.tokenizer import from_directory

        tok = from_directory(tokenizer_dir, "export.checkpoint")  # a directory, never the Hub
        tok.save_pretrained(str(out))
    cfg = hf_config_dict(model_cfg, dtype=DTYPE_JSON[dtype], tokenizer=tok)
    if block is not None:
        cfg.update(fp8.config_keys(block))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    src = model_cfg.get("hf_path")
    if src and (Path(src) / "generation_config.json").is_file():  # checked JSON, from inside src
        gen = Path(src) / "generation_config.json"
        safe_files.read_json_object(gen, "model.hf_path", root=Path(src))
        safe_files.copy_file(gen, out / "generation_config.json", "model.hf_path", root=Path(src))
    safe_files.mark_export(out, "hf_model")  # what export.overwrite may replace


def write_tensors(out: Path, files: list[ShardFile], mine: Iterable[tuple[str, torch.Tensor]],
                  s: mappings.Shapes, rank: int, transform: Transform | None = None,
                  carried: Iterable[tuple[str, torch.Tensor]] = (), block=None) -> None:  # fmt: skip
    """Write this rank's files from (global name, full megatron tensor) pairs, one at a time, then
    the `carried` HF tensors as they are (rank 0: hf/carried.py)."""
    where = {name: f for f in files for name, _, _ in f.entries}
    writers = {f.name: StreamWriter(out / f.name, f.entries) for f in files if f.owner == rank}
    try:
        for name, full in mine:
            if transform is not None:
                full = transform(name, full)
            mp = mappings.resolve(name, s.tie, s)
            for hf, t in mappings.to_hf(mp, full, s).items():
                w = writers[where[hf].name]
                if hf + fp8.SCALE in where:  # an FP8 export: the weight and its block scales
                    q, scale = fp8.quantize(t, block)
                    w.add(hf + fp8.SCALE, scale)
                    t = q
                w.add(hf, t)
            del full
        for hf, t in carried:
            writers[where[hf].name].add(hf, t)
        for w in writers.values():
            w.close()
    finally:
        for w in writers.values():
            if not w.f.closed:
                w.f.close()


def export_format(name: str | None, model_cfg, default: torch.dtype):
    """(dtype, FP8 block or None) of export.dtype: fp32/bf16/fp16, or fp8 (DeepSeek's block format:
    FP8 weights with block scales, the rest bf16; the source's block, else 128 x 128); unset: the
    weights' own dtype."""
    if name == "fp8":
        return torch.bfloat16, list(model_cfg.get("fp8_block") or fp8.DEFAULT_BLOCK)
    return (DTYPES[name] if name else default), None


def exported_names(names: Iterable[str], tie: bool) -> list[str]:
    """The megatron parameters that export writes (a tied output layer is the embedding)."""
    return [
        n
        for n in names
        if mappings.resolve(n, tie) is not None and not (tie and n == "output_layer.weight")
    ]


def _writes(name: str, ranks) -> bool:
    """Whether this rank writes `name`: TP rank 0 of DP rank 0 of its stage; a routed expert's
    parameter: expert-TP rank 0 of expert-DP rank 0 (each EP rank writes its own experts)."""
    tp_rank, dp_rank, etp_rank, edp_rank = ranks
    return (etp_rank, edp_rank) == (0, 0) if is_expert(name) else (tp_rank, dp_rank) == (0, 0)


def _finish_dir(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def write_hf_model(
    state, transform: Transform | None = None, out: str | Path | None = None
) -> Path:
    """`<run.dir>/hf_model/` from the live model (every rank calls it; TP shards are gathered per
    tensor inside each TP group, an expert's inside its expert TP group; tp rank 0 of dp rank 0 of
    each pipeline stage writes its files, and each EP rank its experts': `_writes`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ftcore.data.tokenizer import tokenizer_source
    from ftcore.models.sharding import iter_weights, join_shards, shard_info
    from ftcore.runtime import collectives
    from ftcore.runtime import dist as rdist

    cfg = state.cfg
    out = Path(out) if out else state.run_dir / "hf_model"
    tmp = out.with_name("." + out.name + ".tmp")
    rank = dist.get_rank() if dist.is_initialized() else 0
    s = mappings.Shapes.from_cfg(cfg.model)
    params = [(n, p) for n, p in iter_weights(state.model)]
    names = exported_names([n for n, _ in params], s.tie)
    dtype, block = export_format(cfg.export.get("dtype"), cfg.model, params[0][1].dtype)
    tp, etp = ps.get_tensor_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    ranks = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(with_context_parallel=True),
             ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank())  # fmt: skip
    produced = [h for n in names if _writes(n, ranks) for h in mappings.resolve(n, s.tie, s).hf]
    gathered = [produced]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        collectives.all_gather_object(gathered, produced)
    owners = {h: r for r, hs in enumerate(gathered) for h in hs}
    origin = carried.source(cfg.model)  # every rank plans the same files from the same headers
    kept = carried.carried_names(origin, s.layers, block)
    files = plan_files(s, dtype, lambda h: owners[h], cfg.export.max_shard_gb * 1e9,
                       carried.entries(origin, kept, dtype, block), block)  # fmt: skip
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()

    def full_tensors():  # every rank of a writer's (expert) TP group takes part in its gathers
        for name, p in params:
            expert = is_expert(name)
            if name not in names or (ranks[3] if expert else ranks[1]) != 0:
                continue
            n = etp if expert else tp
            data = p.detach().to(rdist.comm_device()).contiguous()  # no copy where it is already
            if n > 1:
                group = (ps.get_expert_tensor_parallel_group() if expert
                         else ps.get_tensor_model_parallel_group())  # fmt: skip
                shards = [torch.empty_like(data) for _ in range(n)]
                collectives.all_gather(shards, data, group=group)
                data = join_shards(shards, shard_info(name, p, n))
                del shards
            if _writes(name, ranks):
                yield name, data

    copies = ((n, carried.read(origin, n, block)) for n in kept) if rank == 0 else ()
    write_tensors(tmp, files, full_tensors(), s, rank, transform, copies, block)  # else: gathers
    _barrier()
    if rank == 0:
        src, _ = tokenizer_source(cfg)
        write_metadata(tmp, cfg.model, dtype, src, block)
        write_index(tmp, files)
        _finish_dir(tmp, out)
        log.info("wrote %s (%d safetensors files)", out, len(files))
    _barrier()
    return out


def _barrier() -> None:
    import torch.distributed as dist

    from ftcore.runtime import collectives

    if dist.is_initialized() and dist.get_world_size() > 1:
        collectives.barrier()


def export_checkpoint(step_dir: str | Path, run_cfg, out: str | Path, *, dtype: str | None = None,
                      max_shard_gb: float = 5.0, transform: Transform | None = None) -> Path:  # fmt: skip
    """One process: a checkpoint of any layout -> an HF directory, one tensor in memory at a time."""
    from ftcore.data.tokenizer import tokenizer_source
    from ftcore.errors import FtcoreError
    from ftcore.hf.ckpt_reader import CheckpointReader

    reader = CheckpointReader(step_dir)
    s = mappings.Shapes.from_cfg(run_cfg.model)
    names = exported_names(_global_names(s), s.tie)
    missing = [n for n in names if not reader.has(n)]
    if missing:
        raise FtcoreError(f"{step_dir} lacks {missing[0]} (and {len(missing) - 1} more) for the model in "
                          "its config.yaml", field="export.checkpoint",
                          fix="export a checkpoint of this run (or its run.dir's config.yaml unchanged)")  # fmt: skip
    torch_dtype, block = export_format(dtype, run_cfg.model, reader.meta(names[0])[1])
    origin = carried.source(run_cfg.model)
    kept = carried.carried_names(origin, s.layers, block)
    files = plan_files(s, torch_dtype, lambda h: 0, max_shard_gb * 1e9,
                       carried.entries(origin, kept, torch_dtype, block), block)  # fmt: skip
    out = Path(out)
    tmp = out.with_name("." + out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_tensors(tmp, files, ((n, reader.read(n)) for n in names), s, 0, transform,
                  ((n, carried.read(origin, n, block)) for n in kept), block)  # fmt: skip
    src, _ = tokenizer_source(run_cfg)
    write_metadata(tmp, run_cfg.model, torch_dtype, src, block)
    write_index(tmp, files)
    _finish_dir(tmp, out)
    log.info("exported %s -> %s (%d safetensors files)", step_dir, out, len(files))
    return out


def _attention_names(s: mappings.Shapes, a: str) -> list[str]:
    """A layer's attention parameters (local-spec names) under prefix `a`."""
    if s.mla:
        q = (
            ["linear_q_down_proj", "q_layernorm", "linear_q_up_proj"]
            if s.q_lora
            else ["linear_q_proj"]
        )
        q += ["linear_kv_down_proj", "kv_layernorm", "linear_kv_up_proj"]
        return [a + x + ".weight" for x in q]
    names = [a + "linear_qkv.weight"] + ([a + "linear_qkv.bias"] if s.qkv_bias else [])
    return names + ([a + "q_layernorm.weight", a + "k_layernorm.weight"] if s.qk_norm else [])


def _global_names(s: mappings.Shapes) -> list[str]:
    """Every megatron parameter of the model (local-spec names; the router's expert bias, a
    buffer, too), in model order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(s.layers):
        p, a = f"decoder.layers.{i}.", f"decoder.layers.{i}.self_attention."
        names += [p + "input_layernorm.weight", *_attention_names(s, a)]
        names += [a + "linear_proj.weight", p + "pre_mlp_layernorm.weight"]
        if s.sparse(i):  # a MoE layer: its router and every expert, by global index
            x = p + "mlp.experts.local_experts."
            names.append(p + "mlp.router.weight")
            names += [p + "mlp.router.expert_bias"] if s.expert_bias else []
            for e in range(s.experts):
                names += [f"{x}{e}.linear_fc1.weight", f"{x}{e}.linear_fc2.weight"]
            if s.shared_ffn:
                names += [p + f"mlp.shared_experts.linear_fc{k}.weight" for k in (1, 2)]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    return names + ["decoder.final_layernorm.weight", "output_layer.weight"]
