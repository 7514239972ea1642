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
    new = PlanView(
        **{k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in data.items()}
    )
    new._shared = {}  # created here so that every layout `replace` derives shares it
    return new


LAYOUT_SECTIONS = ("parallel", "train")  # what the layout search changes


def shared_cache(cfg) -> dict:
    """A memo shared by every layout derived from one config by `replace` of the layout sections
    (the search's candidates): its keys must name every layout field the value depends on."""
    return view(cfg).__dict__.setdefault("_shared", {})


def memo(cfg, key, make):
    """make() memoised on this layout (a PlanView; a DictConfig is not memoised): dropped by
    `replace`, so the key need not name the layout."""
    if not isinstance(cfg, PlanView):
        return make()
    cache = cfg.__dict__.setdefault("_cache", {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def replace(cfg, **sections) -> PlanView:
    """A copy with some keys changed: replace(cfg, parallel={"tp": 2}, train={...})."""
    new = copy.copy(view(cfg))
    new.__dict__.pop("_cache", None)  # memoised results belong to the old layout
    if set(sections) - set(LAYOUT_SECTIONS):  # another model, cluster, ...: nothing carries over
        new._shared = {}
    for name, values in sections.items():
        sec = copy.copy(getattr(new, name))
        for k, v in values.items():
            setattr(sec, k, v)
        setattr(new, name, sec)
    return new
