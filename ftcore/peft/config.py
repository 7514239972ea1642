"""LoRA settings and their checks, kept free of torch and megatron imports so a config error
exits 2 before anything heavy is imported (validate() and the launching parent use this)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from ftcore.errors import FtcoreError

# Hugging Face names of the slices of each megatron linear, in fused order.
SLICES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
COLUMN = ("linear_qkv", "linear_fc1")

HF_NAMES = {s: m for m, slices in SLICES.items() for s in slices}  # q_proj -> linear_qkv
PARENT = {
    "linear_qkv": "self_attention",
    "linear_proj": "self_attention",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}


def scaling(r: int, alpha: float, rslora: bool) -> float:
    return alpha / (r**0.5) if rslora else alpha / r


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
