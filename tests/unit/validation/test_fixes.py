"""Every user error says how to fix it: each `FtcoreError(...)` raised in ftcore/ and launch/
passes `fix=` (an AST scan of the sources, so a new one without it fails here), and the
divisibility errors name every constraint at once, so following one fix does not lead to the next
refusal."""

from __future__ import annotations

import ast
from pathlib import Path

from omegaconf import OmegaConf

from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.validation import checks
from tests.support.cli import ROOT


def test_every_ftcore_error_has_a_fix():
    missing = []
    for root in ("ftcore", "launch"):
        for f in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if not isinstance(node, ast.Call):
                    continue
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                keys = {k.arg for k in node.keywords}
                if name == "FtcoreError" and "fix" not in keys and None not in keys:
                    missing.append(f"{Path(f).relative_to(ROOT)}:{node.lineno}")
    assert not missing, f"FtcoreError without fix=: {missing}"


def _refusal(overrides: list[str], world: int) -> str:
    cfg = compose(["+exp=tiny_lora", *overrides])
    try:
        checks.check_layout(cfg, world, training=False)
    except FtcoreError as e:
        return str(e)
    raise AssertionError("not refused")


def test_divisibility_names_heads_and_world_size():
    """tp=3 with 2 processes: its fix is a tp that meets the heads and the world size alike, and
    following it runs."""
    msg = _refusal(["parallel.tp=3"], world=2)
    assert "num_attention_heads=8" in msg and "world size 2" in msg and "parallel.tp=1 or 2" in msg
    msg = _refusal(["parallel.tp=4"], world=2)  # what a fix naming the heads alone would lead to
    assert "parallel.tp=1 or 2" in msg
    cfg = compose(["+exp=tiny_lora", "parallel.tp=2"])
    assert checks.check_layout(cfg, 2, training=False) == 1  # the fix leads to a run (dp=1)
    assert OmegaConf.select(cfg, "parallel.tp") == 2
