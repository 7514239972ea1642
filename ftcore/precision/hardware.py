"""The hardware check: whether this machine (or a target GPU, simulated on CPU) runs a precision
recipe, and what would run instead. Every refusal names what the recipe needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import DictConfig

from ftcore.errors import FtcoreError
from ftcore.precision.recipes import (
    FALLBACKS,
    RECIPES,
    check_config,
    check_te_attention,
    recipe_name,
    require,
    te_module,
    te_version,
)


def supported_on(name: str, cc: float, cuda: Optional[float] = None) -> tuple[bool, str]:
    """Whether recipe `name` runs on compute capability `cc` (and CUDA toolkit `cuda`); why not."""
    info = RECIPES[name]
    if cc < info.min_cc or (info.max_cc is not None and cc >= info.max_cc):
        return False, f"needs {info.hardware}; this GPU has compute capability {cc:.1f}"
    if info.min_cuda is not None and cuda is not None and cuda < info.min_cuda:
        return False, f"needs {info.hardware}; torch was built with CUDA {cuda}"
    return True, ""


def cluster_supports(cfg: DictConfig) -> tuple[bool, str]:
    """Whether the target cluster (cluster.device, cluster.compute_capability) runs this precision:
    the planner's view, which needs no GPU here."""
    name = recipe_name(cfg)
    if name is None:
        return True, ""
    cc = cfg.cluster.compute_capability
    if cfg.cluster.device == "cpu" or cc is None:
        return False, f"{cfg.precision.name} needs a GPU of {RECIPES[name].hardware}"
    return supported_on(name, cc)


def fallback(cc: Optional[float], exclude: str, cuda: Optional[float] = None) -> str:
    """The precision option that would run instead: the first FP8 one the device runs, else BF16."""
    if cc is None:
        return "bf16 or fp32"
    for option, name in FALLBACKS:
        if option == exclude:
            continue
        if name is None:
            return option if cc >= 8.0 else "fp32"
        if supported_on(name, cc, cuda)[0]:
            return option
    return "bf16"


@dataclass(frozen=True)
class Device:
    """What the hardware check knows of the machine a run starts on. `this_device()` probes it;
    tests build one for a target GPU (`simulated_device`) to run the very same check on CPU."""

    cuda: bool  # a CUDA device is visible
    cc: Optional[float] = None  # compute capability
    cuda_version: Optional[float] = None  # the CUDA toolkit torch was built with
    te_version: Optional[str] = None  # installed Transformer Engine, None when absent
    ask_te: bool = True  # also ask TE itself (is_fp8_available, ...): only a real TE can answer


def this_device() -> Device:
    cuda = torch.cuda.is_available()
    return Device(cuda, _capability() if cuda else None, _cuda_version(), te_version())


def simulated_device(cfg: DictConfig, te: Optional[str], cuda_version: Optional[float]) -> Device:
    """The target GPU of `cfg.cluster` (its compute capability) with the given TE and CUDA
    versions, for tests on CPU. TE's own run-time probe is skipped: it needs the real device."""
    cc = cfg.cluster.compute_capability
    return Device(
        cfg.cluster.device == "cuda" and cc is not None, cc, cuda_version, te, ask_te=False
    )


def check_hardware(cfg: DictConfig, device: Optional[Device] = None) -> None:
    """Refuse a precision this machine (or the given `device`) cannot run, naming what it needs
    and what would run instead."""
    check_config(cfg)
    dev = device or this_device()
    p, name = cfg.precision, recipe_name(cfg)
    if name is not None and cfg.peft.name == "qlora":
        raise FtcoreError(f"QLoRA keeps the frozen base in NF4 (bitsandbytes), so its GEMMs cannot also be "
                          f"{RECIPES[name].kind.upper()}", field="precision",
                          fix=f"use peft=lora with precision={p.name}, or peft=qlora with precision=bf16")  # fmt: skip
    on_cuda = dev.cuda and cfg.cluster.device != "cpu"
    if on_cuda and cfg.gpu.require_te and cfg.peft.name != "qlora" and p.te_layers:
        require(dev.te_version is not None, "gpu.require_te=true (ftcore's container sets it) but "
                 "Transformer Engine is not installed or cannot load here", "gpu.require_te",
                 "repair the image's transformer-engine, or set gpu.require_te=false to run "
                 "megatron's local layers")  # fmt: skip
    if on_cuda and dev.te_version is not None:
        check_te_attention(cfg)
    if name is None:
        if on_cuda and p.params_dtype == "bf16":
            require(dev.cc >= 8.0, f"BF16 needs compute capability >= 8.0; this GPU has "
                     f"{dev.cc:.1f}", "precision", "use precision=fp32")  # fmt: skip
        return
    info = RECIPES[name]
    if not on_cuda:
        where = "no CUDA device is visible" if not dev.cuda else "cluster.device=cpu runs it on CPU"
        raise FtcoreError(f"{p.name} runs its GEMMs in {info.kind.upper()} (Transformer Engine {info.te_class}) "
                          f"and needs a CUDA GPU of {info.hardware}, but {where}", field="precision",
                          fix=f"on CPU use precision=bf16 or precision=fp32 (ftcore.plan still plans {p.name} jobs)")  # fmt: skip
    cc, cuda = dev.cc, dev.cuda_version
    instead = f"use precision={fallback(cc, p.name, cuda)} on this GPU"
    ok, why = supported_on(name, cc, cuda)
    require(ok, f"{p.name} {why}", "precision", instead)
    version = dev.te_version
    require(version is not None, f"{p.name} needs Transformer Engine, which is not installed", "precision",
             "pip install 'ftcore[gpu]' (or use the NGC PyTorch image), or precision=bf16")  # fmt: skip
    require(not _older(version, info.min_te), f"{p.name} ({info.te_class}) needs Transformer Engine >= "
             f"{info.min_te}; {version} is installed", "precision", f"upgrade transformer-engine, or {instead}")  # fmt: skip
    if dev.ask_te:
        ok, why = te_supports(name)
        require(ok, f"{p.name}: Transformer Engine says {why}", "precision", instead)


def _capability() -> float:
    major, minor = torch.cuda.get_device_capability()
    return major + minor / 10


def _cuda_version() -> Optional[float]:
    try:
        return float(torch.version.cuda) if torch.version.cuda else None
    except ValueError:
        return None


def _older(version: str, minimum: str) -> bool:
    from packaging.version import Version

    return Version(version) < Version(minimum)


def te_supports(name: str) -> tuple[bool, str]:
    """TE's own verdict on this device (it also knows cuBLAS and CUDA versions)."""
    te = te_module()
    probe = {
        "delayed": "is_fp8_available",
        "tensorwise": "is_fp8_available",
        "blockwise": "is_fp8_block_scaling_available",
        "mxfp8": "is_mxfp8_available",
        "nvfp4": "is_nvfp4_available",
    }[name]
    fn = getattr(te, probe, None)
    if fn is not None:
        ok, why = fn(return_reason=True)
        return bool(ok), why
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager  # TE < 2.9

    fn = getattr(FP8GlobalStateManager, probe, None)
    if fn is None:
        return False, f"this version has no {RECIPES[name].te_class}"
    ok, why = fn()
    return bool(ok), why
