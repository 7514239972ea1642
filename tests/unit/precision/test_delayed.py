"""precision/delayed.py: TE's delayed-scaling update after a forward under no_grad (issue 50 item
5). The stand-in below has Transformer Engine 2.9's own rule (pytorch/quantization.py,
`FP8GlobalStateManager.autocast_exit`): the amax reduction and scale update run at the outermost
autocast's exit only when grad is enabled. So DPO's reference forwards and precompute_ref's whole
pass, all under no_grad, ran at the starting scales. ftcore runs TE's update itself after each
(training/objectives/dpo/step.py reference_step; tests/multiproc/test_device_audit.py counts one per reference
forward of a precompute pass)."""

from __future__ import annotations

import sys
import types

import torch

from ftcore.config.schema import compose
from ftcore.precision import delayed, recipes


class FP8GlobalStateManager:
    """TE 2.9's update rule, counting the updates."""

    AUTOCAST_DEPTH = 0
    updates = 0

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        cls.updates += 1

    @classmethod
    def autocast_enter(cls) -> None:
        cls.AUTOCAST_DEPTH += 1

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        cls.AUTOCAST_DEPTH -= 1
        if enabled and cls.AUTOCAST_DEPTH == 0 and not _graph and torch.is_grad_enabled():
            cls.reduce_and_update_fp8_tensors(forward=True)


def forward() -> None:
    """One model forward inside TE's FP8 autocast (megatron's block enters one per forward)."""
    FP8GlobalStateManager.autocast_enter()
    FP8GlobalStateManager.autocast_exit(True, False)


def test_a_no_grad_forward_gets_the_update_a_grad_forward_gets(monkeypatch):
    quantization = types.ModuleType("transformer_engine.pytorch.quantization")
    quantization.FP8GlobalStateManager = FP8GlobalStateManager
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.quantization", quantization)
    monkeypatch.setattr(recipes, "te_module", lambda: object())  # TE is there (a stand-in)
    monkeypatch.setattr(FP8GlobalStateManager, "updates", 0)
    cfg = compose(["+exp=tiny_lora", "precision=fp8_delayed"])
    forward()  # training: grad enabled
    assert FP8GlobalStateManager.updates == 1
    with torch.no_grad():
        forward()  # DPO's reference: TE updates nothing
    assert FP8GlobalStateManager.updates == 1
    delayed.update_after_no_grad_forward(cfg)  # what reference_step does after it
    assert FP8GlobalStateManager.updates == 2
    for other in ("fp8_cs", "bf16"):  # current scaling computes each scale from its tensor
        delayed.update_after_no_grad_forward(compose(["+exp=tiny_lora", f"precision={other}"]))
    assert FP8GlobalStateManager.updates == 2
