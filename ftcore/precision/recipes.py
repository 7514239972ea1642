"""Precision recipes: the `precision` config -> megatron TransformerConfig fields, Transformer Engine
(TE) recipes, the layer spec and the autocast contexts (the hardware check: precision/hardware.py).

FP8/FP4 GEMMs run only through TE on a CUDA GPU. megatron-core's TransformerBlock enters the TE
autocast itself, per layer (so `first_last_bf16_layers` can leave the outer layers in BF16); ftcore
only maps the config onto TransformerConfig, builds with TE's layer spec and checks the hardware.
Nothing here imports TE unless CUDA is in use: on CPU TE cannot even be imported, yet every
mapping and check below is testable there.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from ftcore.errors import FtcoreError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP8_FORMATS = ("e4m3", "hybrid")  # megatron's names; TE's Format.E4M3 / Format.HYBRID
AMAX_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class RecipeInfo:
    """What a TE recipe needs. `min_cc`/`max_cc` are CUDA compute capabilities (max exclusive)."""

    te_class: str  # class in transformer_engine.common.recipe
    kind: str  # fp8 | fp4
    min_te: str  # first TE version megatron-core 0.16 builds this recipe with
    min_cc: float
    max_cc: Optional[float] = None
    min_cuda: Optional[float] = None  # CUDA toolkit torch was built with
    fmt: Optional[str] = None  # default FP8 format (megatron name)
    hardware: str = ""


# Keyed by megatron's recipe names (TransformerConfig.fp8_recipe / fp4_recipe).
RECIPES: dict[str, RecipeInfo] = {
    "delayed": RecipeInfo(
        "DelayedScaling",
        "fp8",
        "2.0",
        8.9,
        fmt="hybrid",
        hardware="compute capability >= 8.9 (Ada, Hopper, Blackwell)",
    ),
    "tensorwise": RecipeInfo(
        "Float8CurrentScaling",
        "fp8",
        "2.2.0.dev0",
        8.9,
        fmt="hybrid",
        hardware="compute capability >= 8.9 (Ada, Hopper, Blackwell)",
    ),
    "blockwise": RecipeInfo(
        "Float8BlockScaling",
        "fp8",
        "2.3.0.dev0",
        9.0,
        min_cuda=12.9,
        fmt="e4m3",
        hardware="compute capability >= 9.0 (Hopper, Blackwell) and CUDA >= 12.9",
    ),
    "mxfp8": RecipeInfo(
        "MXFP8BlockScaling",
        "fp8",
        "2.1.0",
        10.0,
        max_cc=12.0,
        fmt="e4m3",
        hardware="compute capability 10.x (Blackwell: B200, GB200, GB300)",
    ),
    "nvfp4": RecipeInfo(
        "NVFP4BlockScaling",
        "fp4",
        "2.7.0.dev0",
        10.0,
        hardware="compute capability >= 10.0 (Blackwell: B200, GB200, GB300)",
    ),
}
# Precision options tried, in order, as "what would run instead" on a device that lacks one.
FALLBACKS = (("fp8_cs", "tensorwise"), ("fp8_delayed", "delayed"), ("bf16", None))
# Smallest GEMM dimension multiple TE accepts per kind (tokens, features).
ALIGN = {"fp8": (8, 16), "mxfp8": (32, 32), "fp4": (32, 32)}


def recipe_name(cfg: DictConfig) -> Optional[str]:
    """megatron's recipe name (delayed, tensorwise, blockwise, mxfp8, nvfp4) or None (fp32/bf16)."""
    p = cfg.precision
    return p.fp8_recipe or p.fp4_recipe or None


def is_quantized(cfg: DictConfig) -> bool:
    """True when base GEMMs run in FP8 or FP4."""
    return recipe_name(cfg) is not None


def fp8_format(cfg: DictConfig) -> Optional[str]:
    """The FP8 format: precision.fp8_format, else the recipe's default (None without FP8)."""
    name = cfg.precision.fp8_recipe
    if not name:
        return None
    return cfg.precision.get("fp8_format") or RECIPES[name].fmt


def transformer_config_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """The precision fields of megatron's TransformerConfig for this config."""
    p = cfg.precision
    dtype = DTYPES[p.params_dtype]
    n = p.first_last_bf16_layers
    kw: dict[str, Any] = {
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "fp16": False,
        "fp8": None,
        "fp8_param": False,
        "fp4": None,
        "fp4_param": False,
        "fp8_dot_product_attention": False,
        "first_last_layers_bf16": n > 0,
        "num_layers_at_start_in_bf16": n,
        "num_layers_at_end_in_bf16": n,
    }
    if p.fp8_recipe:
        kw.update(
            fp8=fp8_format(cfg),
            fp8_recipe=p.fp8_recipe,
            fp8_param=p.fp8_param_gather,
            fp8_dot_product_attention=p.fp8_attention,
            fp8_margin=p.fp8_margin,
            fp8_amax_history_len=p.fp8_amax_history_len,
            fp8_amax_compute_algo=p.fp8_amax_compute_algo,
        )
    elif p.fp4_recipe:
        kw.update(fp4="e2m1", fp4_recipe=p.fp4_recipe, fp4_param=p.fp8_param_gather)
    return kw


def ddp_config_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """Fields for megatron's DistributedDataParallelConfig: gather FP8/FP4 params, not BF16 ones."""
    return {"fp8_param_gather": bool(is_quantized(cfg) and cfg.precision.fp8_param_gather)}


def te_recipe_spec(cfg: DictConfig) -> Optional[tuple[str, dict[str, Any]]]:
    """(TE recipe class name, constructor kwargs) for this config, or None without FP8/FP4.

    Formats are given by name ("HYBRID", "E4M3") so this is testable without TE."""
    name = recipe_name(cfg)
    if name is None:
        return None
    p, info = cfg.precision, RECIPES[name]
    if info.kind == "fp4":
        return info.te_class, {}  # E2M1 data, E4M3 block scales: TE's NVFP4 defaults
    kw: dict[str, Any] = {"fp8_format": fp8_format(cfg).upper()}
    if name == "delayed":
        kw.update(
            margin=p.fp8_margin,
            amax_history_len=p.fp8_amax_history_len,
            amax_compute_algo=p.fp8_amax_compute_algo,
            fp8_dpa=p.fp8_attention,
        )
    elif name == "tensorwise":
        kw.update(fp8_dpa=p.fp8_attention)
    return info.te_class, kw


def te_recipe(cfg: DictConfig):
    """The Transformer Engine recipe object (needs TE), or None without FP8/FP4."""
    spec = te_recipe_spec(cfg)
    if spec is None:
        return None
    from transformer_engine.common import recipe as te_recipes

    cls_name, kw = spec
    if "fp8_format" in kw:
        kw = dict(kw, fp8_format=getattr(te_recipes.Format, kw["fp8_format"]))
    return getattr(te_recipes, cls_name)(**kw)


def require(ok: bool, message: str, field: str, fix: Optional[str] = None) -> None:
    if not ok:
        raise FtcoreError(message, field=field, fix=fix)


def check_config(cfg: DictConfig) -> None:
    """Device-independent rules of the precision section (also run by check_hardware)."""
    p = cfg.precision
    require(p.params_dtype in DTYPES, f"{p.params_dtype!r} is not one of fp32, bf16",
             "precision.params_dtype")  # fmt: skip
    require(not (p.fp8_recipe and p.fp4_recipe), "set fp8_recipe or fp4_recipe, not both", "precision",
             "pick one option: precision=fp8_cs, precision=nvfp4, ...")  # fmt: skip
    fp8_names = [k for k, v in RECIPES.items() if v.kind == "fp8"]
    require(p.fp8_recipe in (None, *fp8_names), f"{p.fp8_recipe!r} is not one of {', '.join(fp8_names)}",
             "precision.fp8_recipe")  # fmt: skip
    require(p.fp4_recipe in (None, "nvfp4"), f"{p.fp4_recipe!r} is not nvfp4",
             "precision.fp4_recipe")  # fmt: skip
    require(p.get("fp8_format") in (None, *FP8_FORMATS), f"{p.get('fp8_format')!r} is not one of e4m3, hybrid",
             "precision.fp8_format")  # fmt: skip
    require(p.fp8_amax_compute_algo in AMAX_ALGOS, f"{p.fp8_amax_compute_algo!r} is not one of max, most_recent",
             "precision.fp8_amax_compute_algo")  # fmt: skip
    name = recipe_name(cfg)
    if name is None:
        for key in ("fp8_param_gather", "fp8_attention"):
            require(not p[key], f"{p.name} has no FP8/FP4 GEMMs", f"precision.{key}",
                     f"set precision.{key}=false or pick an FP8/FP4 precision")  # fmt: skip
        require(not p.first_last_bf16_layers, f"{p.name} has no FP8/FP4 layers to keep in BF16",
                 "precision.first_last_bf16_layers", "set it to 0")  # fmt: skip
        return
    require(p.te_layers, f"{p.name} runs through Transformer Engine layers", "precision.te_layers",
             "set precision.te_layers=true, or use precision=bf16")  # fmt: skip
    require(p.params_dtype == "bf16", f"{p.name} keeps its high-precision weights in BF16",
             "precision.params_dtype", "set precision.params_dtype=bf16")  # fmt: skip
    require(not p.fp8_attention or name in ("delayed", "tensorwise"),
             f"FP8 attention is supported with delayed or tensorwise scaling, not {name}",
             "precision.fp8_attention", "set precision.fp8_attention=false or use precision=fp8_cs")  # fmt: skip
    _check_first_last(cfg, name)
    _check_alignment(cfg, name)


def _check_first_last(cfg: DictConfig, name: str) -> None:
    n, layers, pp = cfg.precision.first_last_bf16_layers, cfg.model.num_layers, cfg.parallel.pp
    field = "precision.first_last_bf16_layers"
    require(n >= 0, f"must be >= 0, got {n}", field)
    if n == 0:
        return
    require(name != "delayed",
             "delayed scaling shares one amax history across the model and cannot leave layers in BF16",
             field, "set it to 0, or use precision=fp8_cs (current scaling)")  # fmt: skip
    require(2 * n < layers, f"{n} BF16 layers at each end leave none of {layers} in {name}", field,
             "use a smaller number, or precision=bf16")  # fmt: skip
    require(n <= layers // pp, f"{n} is more than the {layers // pp} layers of one pipeline stage", field,
             f"use at most {layers // pp}")  # fmt: skip


def _check_alignment(cfg: DictConfig, name: str) -> None:
    """TE's FP8/FP4 GEMMs need every GEMM dimension to be a multiple of a small number."""
    tok_align, feat_align = ALIGN["mxfp8" if name == "mxfp8" else RECIPES[name].kind]
    m, par = cfg.model, cfg.parallel
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    feats = {
        "model.hidden_size": m.hidden_size,
        "model.ffn_hidden_size (per TP rank)": m.ffn_hidden_size // par.tp,
        "heads x kv_channels (per TP rank)": (m.num_attention_heads * kv) // par.tp,
    }
    for what, size in feats.items():
        require(size % feat_align == 0, f"{what}={size} is not a multiple of {feat_align}, which {name} "
                 "GEMMs need", "precision", "use precision=bf16 for this model shape")  # fmt: skip
    split = par.cp * (par.tp if par.sp else 1)  # the sequence is cut this many ways per rank
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len // split
    require(tokens % tok_align == 0,
             f"a micro-batch holds {tokens} tokens per rank, not a multiple of {tok_align} as {name} needs",
             "data.seq_len", f"make micro_batch_size*seq_len a multiple of {tok_align * split}")  # fmt: skip


def check_te_attention(cfg: DictConfig) -> None:
    """Where Transformer Engine's layers run, its attention must find a backend. TE 2.9
    (transformer_engine/pytorch/attention/dot_product_attention/utils.py get_attention_backend):
    flash and fused attention take bf16/fp16 (and FP8) inputs only, and the unfused one refuses
    the packed THD layout and context parallelism, so fp32 with packing or cp > 1 leaves none
    ("no dot product attention backend"). Callers decide that TE's layers are built."""
    p = cfg.precision
    if p.params_dtype != "fp32" or not p.te_layers or cfg.peft.name == "qlora":
        return
    why = [w for w, on in (("packed rows (THD)", cfg.data.packing),
                           (f"context parallelism (cp={cfg.parallel.cp})", cfg.parallel.cp > 1)) if on]  # fmt: skip
    require(not why, f"fp32 with Transformer Engine's layers and {' and '.join(why)} leaves TE no "
             "attention backend: its flash and fused attention need bf16/fp16, its unfused one "
             "takes neither", "precision",
             "use precision=bf16, or precision.te_layers=false (megatron's local layers run fp32)")  # fmt: skip


def runs_on_cuda(cfg: DictConfig) -> bool:
    """The same rule as the runtime's: CUDA when a GPU is visible and cluster.device is not cpu."""
    return torch.cuda.is_available() and cfg.cluster.device != "cpu"


def check_merge(cfg: DictConfig) -> None:
    """Refuse merging LoRA adapters into a base whose GEMMs run in FP8/FP4.

    The trained model computes Q(W)x + BAx with the adapter in BF16. Merged, it would compute
    Q(W + BA)x: the update BA is typically far below the FP8/FP4 step at W's magnitude (E4M3 keeps
    3 mantissa bits, E2M1 one), so it rounds away and the merged model loses the fine-tuning."""
    name = recipe_name(cfg)
    if name is None:
        return
    fmt = "FP4 (E2M1)" if RECIPES[name].kind == "fp4" else "FP8"
    raise FtcoreError(
        f"merging the adapter into a {fmt} base ({cfg.precision.name}) is refused: the low-rank "
        f"update is smaller than the {fmt} rounding step of the base weights and would round away",
        field="export.merge",
        fix="export the adapter alone (export.merge=false: hf_adapter/) and serve it unmerged on the "
        "base; merging is for runs trained in bf16 or fp32",
    )


@functools.lru_cache(maxsize=1)
def te_module():
    """transformer_engine.pytorch, or None: never imported without CUDA (it fails there)."""
    if not torch.cuda.is_available():
        return None
    try:
        import transformer_engine.pytorch as te_pytorch
    except Exception:  # ImportError, or OSError from missing CUDA libraries
        return None
    return te_pytorch


def te_version() -> Optional[str]:
    """The installed Transformer Engine version, or None when it cannot be used here."""
    if te_module() is None:
        return None
    import transformer_engine

    return str(getattr(transformer_engine, "__version__", "0"))


def use_te(cfg: DictConfig) -> bool:
    """Build with TE layers: on CUDA when TE is installed, unless precision.te_layers=false. QLoRA
    keeps megatron's local layers, whose plain weights bitsandbytes quantises to NF4."""
    if not runs_on_cuda(cfg) or cfg.peft.name == "qlora" or not cfg.precision.te_layers:
        return False
    return te_module() is not None


def layer_spec(cfg: DictConfig):
    """megatron's TE layer spec on GPU (required for FP8/FP4); None means: use the local spec."""
    if not use_te(cfg):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from ftcore.config.families import family

    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=None, **family(cfg.model).spec_flags
    )


def _autocast(te, enabled: bool, recipe=None, group=None):
    if hasattr(te, "autocast"):  # TE >= 2.9; fp8_autocast is deprecated there
        return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)


@contextlib.contextmanager
def adapter_autocast_off():
    """Run the enclosed (LoRA adapter) GEMMs in BF16 even inside an FP8/FP4 autocast; no-op
    without TE. Adapters are small, so their FP8 speed-up is nil and their updates need BF16."""
    te = te_module()
    if te is None:
        yield
        return
    with _autocast(te, enabled=False):
        yield


def high_precision(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor for adapter GEMMs: dequantise TE's FP8/FP4 tensors, pass others through."""
    if te_module() is None:
        return x
    from transformer_engine.pytorch.tensor import QuantizedTensor

    return x.dequantize() if isinstance(x, QuantizedTensor) else x


@contextlib.contextmanager
def autocast(cfg: DictConfig):
    """The config's FP8/FP4 autocast for TE modules used outside megatron's TransformerBlock (which
    enters its own per layer); a no-op for fp32/bf16 or without TE."""
    te = te_module()
    if te is None or not is_quantized(cfg):
        yield
        return
    from megatron.core import parallel_state as ps

    group = None
    if ps.model_parallel_is_initialized():
        group = ps.get_amax_reduction_group(with_context_parallel=True)
    with _autocast(te, enabled=True, recipe=te_recipe(cfg), group=group):
        yield
