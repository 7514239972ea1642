"""What cpu_vs_hf compares, and what it refuses to: the pairs of a benchmark and their verdicts.

A pair is one ftcore run and the HF recipe it is measured against (`bench.runs[].hf`: `flattened`
for ftcore packed, `padded` for ftcore padded), on each model of `bench.models`. A pair is
comparable when both sides trained on the same documents in the same optimizer steps (same step
count, same digest of the step groups, same tokens and target tokens, over the epoch and over the
measured steps) and their validation losses after the epoch are within `bench.loss_tolerance`
(relative); otherwise it is refused, with the reason, and left out of the medians.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from ftcore.bench.runner import Run, expand_runs
from ftcore.errors import FtcoreError

COLLATORS = ("padded", "flattened")
SAME = ("steps", "measured_steps", "groups_digest", "tokens", "target_tokens", "epoch_tokens",
        "epoch_target_tokens")  # fmt: skip


@dataclass
class Pair:
    run: Run  # the ftcore side
    hf: str  # the HF recipe's collator


@dataclass
class Model:
    label: str
    shape: dict = field(default_factory=dict)  # over bench.hf.shape


def pairs_of(bench: DictConfig) -> list[Pair]:
    """bench.runs, each naming its HF recipe (`hf: flattened | padded`); checked up front."""
    runs = expand_runs(bench)
    if bench.sweep:
        raise FtcoreError("cpu_vs_hf pairs each ftcore run with an HF recipe; a sweep names none",
                          field="bench.sweep", fix="list the runs in bench.runs, each with hf:")  # fmt: skip
    out = []
    for i, (raw, run) in enumerate(zip(bench.runs, runs)):
        hf = raw.get("hf") if isinstance(raw, DictConfig) else None
        if hf not in COLLATORS:
            raise FtcoreError(f"run {run.label!r} names HF recipe {hf!r}", field=f"bench.runs[{i}].hf",
                              fix="flattened (for ftcore packed) or padded (for ftcore padded)")  # fmt: skip
        out.append(Pair(run, str(hf)))
    return out


def models_of(bench: DictConfig) -> list[Model]:
    """bench.models (each {label, shape}: over bench.hf.shape), or the one model of bench.hf."""
    raw = OmegaConf.to_container(bench.models, resolve=True) if bench.get("models") else []
    models = [Model(str(m.get("label") or f"model{i}"), dict(m.get("shape") or {}))
              for i, m in enumerate(raw)] or [Model("model")]  # fmt: skip
    labels = [m.label for m in models]
    if len(set(labels)) != len(labels):
        raise FtcoreError(f"duplicate model labels {labels}", field="bench.models",
                          fix="give each model a distinct label")  # fmt: skip
    if not 0 < float(bench.loss_tolerance) < 1:
        raise FtcoreError(f"{bench.loss_tolerance} is not in (0, 1)", field="bench.loss_tolerance",
                          fix="a relative tolerance, e.g. 0.02")  # fmt: skip
    return models


def compare(hf: dict, ft: dict, tolerance: float) -> dict:
    """The ftcore line's comparison with its HF line: ratios, eval-loss difference, and whether
    the pair is comparable (else why not)."""
    if hf.get("status") != "ok" or ft.get("status") != "ok":
        return {"comparable": False, "reason": "a side failed"}
    reasons = [f"{k}: ftcore {ft.get(k)}, HF {hf.get(k)}" for k in SAME if ft.get(k) != hf.get(k)]
    diff = (ft["eval_loss"] - hf["eval_loss"]) / hf["eval_loss"]
    if not abs(diff) <= tolerance:
        reasons.append(f"eval loss {ft['eval_loss']:.4f} vs HF {hf['eval_loss']:.4f} "
                       f"({100 * diff:+.1f}%, over bench.loss_tolerance {tolerance:g})")  # fmt: skip
    out = {"comparable": not reasons, "reason": "; ".join(reasons) or None,
           "eval_loss_rel_diff": diff, "ratio_vs_hf": ft["tokens_per_s"] / hf["tokens_per_s"]}  # fmt: skip
    if ft.get("cpu_s") and hf.get("cpu_s"):
        out["ratio_vs_hf_cpu"] = hf["cpu_s"] / ft["cpu_s"]  # same tokens: the inverse CPU time
    return out


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def headline(lines: list[dict]) -> list[dict]:
    """One row per (model, pair), over the rounds: medians over the comparable rounds only."""
    out = []
    ft_lines = [ln for ln in lines if ln.get("side") == "ftcore"]
    for key in dict.fromkeys((ln.get("model"), ln.get("pair")) for ln in ft_lines):
        fts = [ln for ln in ft_lines if (ln.get("model"), ln.get("pair")) == key]
        hfs = {ln.get("round"): ln for ln in lines if ln.get("side") == "hf"
               and (ln.get("model"), ln.get("pair")) == key}  # fmt: skip
        good = [
            (ft, hfs[ft.get("round")])
            for ft in fts
            if ft.get("comparable") and ft.get("round") in hfs
        ]
        ratios = [ft["ratio_vs_hf"] for ft, _ in good]
        out.append({
            "model": key[0], "pair": key[1], "rounds": len(fts), "comparable_rounds": len(good),
            "ftcore": fts[0].get("label"), "hf": next(iter(hfs.values()), {}).get("label"),
            "ratio": _med(ratios), "ratio_range": (min(ratios), max(ratios)) if ratios else None,
            "ratio_cpu": _med([ft.get("ratio_vs_hf_cpu") for ft, _ in good]),
            "eff_ftcore": _med([ft.get("efficiency") for ft, _ in good]),
            "eff_hf": _med([h.get("efficiency") for _, h in good]),
            "eval_ftcore": _med([ft.get("eval_loss") for ft, _ in good]),
            "eval_hf": _med([h.get("eval_loss") for _, h in good]),
            "tokens": good[0][0].get("tokens") if good else None,
            "target_tokens": good[0][0].get("target_tokens") if good else None,
            "refused": [f"round {ft.get('round')}: {ft.get('reason')}" for ft in fts if not ft.get("comparable")],
        })  # fmt: skip
    return out
