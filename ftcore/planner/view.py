"""A plain, read-only snapshot of the config for the planner's inner loops.

OmegaConf attribute access costs microseconds; the planner reads shapes thousands of times per
layout and the search tries hundreds of layouts. `view(cfg)` copies each section into a
SimpleNamespace once (values stay plain Python: dicts, lists, numbers); `replace` derives a layout.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

from omegaconf import DictConfig, OmegaConf


class PlanView(SimpleNamespace):
    """cfg.section.key, like the DictConfig it was made from."""


def view(cfg) -> PlanView:
    if isinstance(cfg, PlanView):
        return cfg
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    return PlanView(
        **{k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in data.items()}
    )


def replace(cfg, **sections) -> PlanView:
    """A copy with some keys changed: replace(cfg, parallel={"tp": 2}, train={...})."""
    new = copy.copy(view(cfg))
    new.__dict__.pop("_cache", None)  # memoised results belong to the old layout
    for name, values in sections.items():
        sec = copy.copy(getattr(new, name))
        for k, v in values.items():
            setattr(sec, k, v)
        setattr(new, name, sec)
    return new
