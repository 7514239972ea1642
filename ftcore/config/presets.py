"""A preset's optional evaluation, adapted to the data the user brings.

`+exp=tiny_lora` turns on periodic evaluation and exact-match accuracy for its bundled data. With
the user's own `data.path` (no validation file) or text data those extras had nothing to work on
and stopped the run. Here they adapt instead: a held-out fraction of the user's data becomes the
validation set, and accuracy is skipped (one logged line) where the data has no answers to match.
Only what the user set explicitly on the command line (`run.overrides`) is refused.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")

HELD_OUT = 0.1  # share of data.path held out for a preset's evaluation when no val file is given


def explicit_keys(cfg: DictConfig) -> set[str]:
    """The keys the command line set (`key=v`, `+key=v`, `++key=v`, `~key`)."""
    keys = set()
    for o in cfg.run.get("overrides") or []:
        keys.add(o.split("=", 1)[0].lstrip("+~"))
    return keys


def _answerless(cfg: DictConfig, training: bool) -> bool:
    """True when the evaluation data has no answers to match (text data)."""
    d = cfg.data
    if training and d.mix and not d.val_path:
        return all((m.get("format") or d.format) == "text" for m in d.mix)
    return d.format == "text"


def _no_held_out(cfg: DictConfig) -> bool:
    """Training on the user's data with neither a validation file nor a held-out fraction."""
    d = cfg.data
    return bool(d.path or d.mix) and not d.val_path and d.val_fraction == 0


def adapt(cfg: DictConfig, *, training: bool, say: bool) -> None:
    """Fit the preset's evaluation to the data (in place); refuse what the user set explicitly
    that cannot work. `say`: log what was changed (one process of the job does)."""
    e, d = cfg.eval, cfg.data
    user = explicit_keys(cfg)
    note = log.info if say else (lambda *a: None)
    if e.accuracy and _answerless(cfg, training):
        if "eval.accuracy" in user:
            raise FtcoreError("exact-match accuracy needs answers to match, and text data has none",
                              field="eval.accuracy",
                              fix="use instruction or chat data, or eval.accuracy=false")  # fmt: skip
        e.accuracy = False
        note("eval.accuracy (set by the preset) skipped: %s data has no answers to match", d.format)
    p = cfg.parallel
    if e.accuracy and (p.cp > 1 or (p.pp > 1 and p.vp > 1)) and "eval.accuracy" not in user:
        e.accuracy = False  # decoding runs neither (validation/checks.py refuses an explicit one)
        note(
            "eval.accuracy (set by the preset) skipped: generation does not run at parallel.cp "
            "> 1 or under the interleaved schedule (vp > 1); ftcore.eval measures it at cp=vp=1"
        )
    if not training or not (e.accuracy or e.interval > 0) or not _no_held_out(cfg):
        return
    if "data.val_fraction" not in user:
        d.val_fraction = HELD_OUT
        note("evaluation holds out %d%% of the training data (data.val_fraction=%g): no "
             "data.val_path was given", round(100 * HELD_OUT), HELD_OUT)  # fmt: skip
    elif e.accuracy and "eval.accuracy" in user:
        raise FtcoreError("no held-out data to compute accuracy on", field="eval.accuracy",
                          fix="set data.val_path or data.val_fraction>0, or eval.accuracy=false")  # fmt: skip
    elif e.accuracy:
        e.accuracy = False
        note("eval.accuracy (set by the preset) skipped: data.val_fraction=0 and no data.val_path")
