"""DPO's reference inside the policy model (no second copy): the base with the adapters switched
off, or the base with a reference adapter's weights swapped in for the length of a forward (TRL's
`use_adapter(model, "ref")`; docs/preference.md)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ftcore.models.sharding import iter_params
from ftcore.peft.layers import LoraParallelLinear


def _lora_layers(chunks) -> list:
    """The modules with an adapter switch: LoRA linears (experts' too) and adapted routers."""
    return [m for chunk in chunks for m in chunk.modules()
            if isinstance(m, LoraParallelLinear) or hasattr(m, "adapters_on")]  # fmt: skip


@contextlib.contextmanager
def adapters_off(chunks):
    """Every LoRA linear and adapted router of `chunks` runs its frozen base alone while inside."""
    layers = _lora_layers(chunks)
    for m in layers:
        m.adapters_on = False
    try:
        yield
    finally:
        for m in layers:
            m.adapters_on = True


def _adapter_params(chunks) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in iter_params(chunks) if ".lora_A." in n or ".lora_B." in n]


@torch.no_grad()
def snapshot(chunks) -> dict[str, torch.Tensor]:
    """A copy of this rank's adapter shards (the reference adapter's, once loaded)."""
    return {n: p.detach().clone() for n, p in _adapter_params(chunks)}


@contextlib.contextmanager
def adapter_swapped(chunks, weights: dict[str, torch.Tensor]):
    """The adapters hold `weights` while inside, their own values again after (copied in place:
    DDP's and the distributed optimizer's buffers keep viewing the same storage)."""
    params = _adapter_params(chunks)
    with torch.no_grad():
        saved = [p.detach().clone() for _, p in params]
        for n, p in params:
            p.copy_(weights[n])
    try:
        yield
    finally:
        with torch.no_grad():
            for (_, p), s in zip(params, saved, strict=True):
                p.copy_(s)


@torch.no_grad()
def load_reference_adapter(chunks, cfg, path: str) -> dict[str, torch.Tensor]:
    """The shards of the adapter at `path`, read into the model and copied out; the model's own
    adapter values are put back."""
    from ftcore.peft.adapter_format import load_hf_adapter
    from ftcore.peft.config import settings

    own = snapshot(chunks)
    load_hf_adapter(chunks, dataclasses.replace(settings(cfg), adapter_path=path), cfg)
    ref = snapshot(chunks)
    for n, p in _adapter_params(chunks):
        p.copy_(own[n])
    return ref
