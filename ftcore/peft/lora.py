"""Apply LoRA/QLoRA to this rank's megatron chunks: freeze the base, wrap the target linears, give
the adapters a layout-independent init (or an existing PEFT adapter's weights).

Target names: Hugging Face names (q_proj ... down_proj) put one adapter on exactly that slice of the
fused megatron layer, as PEFT means them; megatron names (linear_qkv, linear_proj, linear_fc1,
linear_fc2) put one adapter with a shared A on the whole fused layer (NeMo's meaning).
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from omegaconf import DictConfig

from ftcore.errors import FtcoreError
from ftcore.models.sharding import iter_params, shard_info, take_shard, unwrap
from ftcore.peft.layers import COLUMN, SLICES, Geometry, LoraParallelLinear, scaling  # noqa: F401
from ftcore.peft.te_layers import lora_linear  # the TE variant over TE linears (GPU spec)

log = logging.getLogger("ftcore")

HF_NAMES = {s: m for m, slices in SLICES.items() for s in slices}  # q_proj -> linear_qkv
PARENT = {
    "linear_qkv": "self_attention",
    "linear_proj": "self_attention",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LoraSettings:
    """The adapter's hyper-parameters: the config's, or those of `peft.adapter_path`."""

    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    rslora: bool
    adapter_path: str | None = None

    @property
    def scale(self) -> float:
        return scaling(self.r, self.alpha, self.rslora)


def plan_targets(targets) -> dict[str, dict[str, str]]:
    """{megatron module: {slice (HF name): A key}}; A key = the slice itself, or the megatron name
    when the slices share one A."""
    plan: dict[str, dict[str, str]] = {}
    given: dict[str, str] = {}
    for t in targets:
        t = str(t)
        if t in SLICES:
            shared = t if len(SLICES[t]) > 1 else SLICES[t][0]
            pairs = [(t, s, shared) for s in SLICES[t]]
        elif t in HF_NAMES:
            pairs = [(HF_NAMES[t], t, t)]
        else:
            raise FtcoreError(
                f"unknown target module {t!r}",
                field="peft.target_modules",
                fix=f"use Hugging Face names ({', '.join(HF_NAMES)}) or megatron names ({', '.join(SLICES)})",
            )
        for module, s, key in pairs:
            if s in given and given[s] != t:
                raise FtcoreError(
                    f"{t!r} and {given[s]!r} both put an adapter on {s}",
                    field="peft.target_modules",
                    fix="name each linear once, by its Hugging Face or its megatron name",
                )
            given[s] = t
            plan.setdefault(module, {})[s] = key
    return {m: plan[m] for m in SLICES if m in plan}


def read_adapter_config(path: str) -> dict:
    f = Path(path) / "adapter_config.json"
    if not f.is_file():
        raise FtcoreError(f"{f} does not exist", field="peft.adapter_path",
                          fix="point peft.adapter_path at a PEFT adapter directory (e.g. a run's hf_adapter/)")  # fmt: skip
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise FtcoreError(f"{f} is not valid JSON: {e}", field="peft.adapter_path") from e


def settings(cfg: DictConfig) -> LoraSettings:
    """The effective adapter settings; an adapter_path's adapter_config.json fixes r, alpha, targets
    and rslora."""
    p = cfg.peft
    r, alpha, targets, rslora = p.r, p.lora_alpha, tuple(p.target_modules), p.use_rslora
    if p.adapter_path:
        ac = read_adapter_config(p.adapter_path)
        if str(ac.get("peft_type", "LORA")).upper() != "LORA":
            raise FtcoreError(f"{p.adapter_path} holds a {ac['peft_type']} adapter, not LoRA",
                              field="peft.adapter_path")  # fmt: skip
        tm = ac.get("target_modules") or []
        targets = tuple(
            sorted(tm, key=list(HF_NAMES).index) if all(t in HF_NAMES for t in tm) else tm
        )
        r, alpha, rslora = (
            ac.get("r", r),
            ac.get("lora_alpha", alpha),
            bool(ac.get("use_rslora", False)),
        )
    return LoraSettings(
        int(r), float(alpha), float(p.lora_dropout), targets, bool(rslora), p.adapter_path
    )


def check_config(cfg: DictConfig) -> None:
    """Refuse bad PEFT settings before anything is built (validate() calls this)."""
    p = cfg.peft
    if p.name == "none":
        return
    if p.name == "qlora" and (cfg.precision.fp8_recipe or cfg.precision.fp4_recipe):
        raise FtcoreError(
            f"QLoRA keeps the frozen base in NF4, so it cannot also run {cfg.precision.name}",
            field="precision", fix="use peft=lora with FP8/FP4, or peft=qlora with precision=bf16",
        )  # fmt: skip
    s = settings(cfg)
    if s.r <= 0:
        raise FtcoreError(f"rank must be > 0, got {s.r}", field="peft.r", fix="use e.g. peft.r=16")
    if not s.alpha > 0:
        raise FtcoreError(f"lora_alpha must be > 0, got {s.alpha}", field="peft.lora_alpha")
    if not 0.0 <= s.dropout < 1.0:
        raise FtcoreError(
            f"lora_dropout must be in [0, 1), got {s.dropout}", field="peft.lora_dropout"
        )
    if not s.targets:
        raise FtcoreError("no target modules", field="peft.target_modules",
                          fix="e.g. peft.target_modules=[q_proj,k_proj,v_proj,o_proj]")  # fmt: skip
    plan_targets(s.targets)
    if s.adapter_path:
        from ftcore.peft.export import check_adapter_fits

        check_adapter_fits(s.adapter_path, cfg.model)


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) + 7) % (2**63))
    return g


@torch.no_grad()
def init_adapters(chunks, seed: int) -> None:
    """A: PEFT's kaiming-uniform (bound 1/sqrt(full fan-in)) drawn as the full tensor from a
    generator seeded by the global name, then sliced; B: zeros. Identical at any TP/PP."""
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, p in iter_params(chunks):
        if ".lora_A." in name:
            info = shard_info(name, p, tp)
            bound = 1.0 / math.sqrt(info.full_shape[1])
            full = torch.empty(info.full_shape).uniform_(
                -bound, bound, generator=_generator(seed, name)
            )
            p.copy_(take_shard(full, info, tp_rank, tp).to(p.dtype))
        elif ".lora_B." in name:
            p.zero_()


def _layers(chunks):
    for chunk in chunks:
        yield from unwrap(chunk).decoder.layers


def apply_peft(cfg: DictConfig, chunks: list) -> LoraSettings:
    """Freeze the base, (QLoRA: quantise its linears to NF4), add adapters, init or load them."""
    check_config(cfg)
    s = settings(cfg)
    plan = plan_targets(s.targets)
    config = unwrap(chunks[0]).config
    geo = Geometry.of(config)
    tp = ps.get_tensor_model_parallel_world_size()
    sp = bool(config.sequence_parallel) and tp > 1
    dtype = DTYPES[cfg.precision.params_dtype]
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
    quantize = None
    if cfg.peft.name == "qlora":
        from ftcore.peft.qlora import quantize_linear

        quantize = quantize_linear
    for layer in _layers(chunks):
        for module, parent_name in PARENT.items():
            parent = getattr(layer, parent_name)
            base = getattr(parent, module)
            if quantize is not None:
                base = quantize(base, double_quant=cfg.peft.double_quant, sp=sp)
            if module in plan:
                base = lora_linear(base, module, plan[module], geo=geo, r=s.r, scale=s.scale,
                                   dropout=s.dropout, tp=tp, sp=sp, dtype=dtype)  # fmt: skip
            setattr(parent, module, base)
    init_adapters(chunks, cfg.run.seed)
    if s.adapter_path:
        from ftcore.peft.export import load_hf_adapter

        load_hf_adapter(chunks, s, cfg)
    trainable, total = count_params(cfg, chunks)
    if dist.get_rank() == 0 if dist.is_initialized() else True:
        log.info("trainable params: %s || all params: %s || trainable%%: %.4f",
                 f"{trainable:,d}", f"{total:,d}", 100 * trainable / total)  # fmt: skip
    return s


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
        if not first_dp:
            break
        if cfg.model.tie_embeddings and name.startswith("output_layer"):
            continue
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue
        n = getattr(p, "logical_numel", p.numel())
        rows = _vocab_rows(name, p, vocab)
        if rows is not None:
            n = rows * p.shape[1]
        total += n
        trainable += n if p.requires_grad else 0
    t = torch.tensor([trainable, total], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return int(t[0]), int(t[1])


def lora_modules(chunks):
    """(global layer index, megatron module name, LoraParallelLinear) of this rank."""
    for layer in _layers(chunks):
        for module, parent_name in PARENT.items():
            m = getattr(getattr(layer, parent_name), module)
            if isinstance(m, LoraParallelLinear):
                yield layer.layer_number - 1, module, m


__all__ = [
    "COLUMN",
    "LoraSettings",
    "apply_peft",
    "check_config",
    "count_params",
    "plan_targets",
    "settings",
]
