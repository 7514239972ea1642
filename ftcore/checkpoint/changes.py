"""What a resumed run may change from the config its checkpoint was saved with.

A resumed run never keeps a checkpoint's setting over its own without saying so:
- another model or PEFT mode, or adapters of another shape: refused (the weights mean nothing);
- what decides the rows of the data stream (data.path, seq_len, packing, run.seed, ...): refused
  unless named in `checkpoint.allow_changed`, because the saved data position points into the old
  stream; allowed, the new data is read from its start and the step count goes on;
- everything else (optim.lr, the schedule, train.max_steps, eval, ...) is applied: the run is
  built from its own settings, and the LR schedule is rebuilt from them at the resumed step
  (training/optim.py). The log names each change, old -> new.
The layout (parallel, launcher), run bookkeeping and checkpoint keys are not compared here.
"""

from __future__ import annotations

import logging

from omegaconf import OmegaConf

from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files

log = logging.getLogger("ftcore")

# Keys whose change makes the saved weights meaningless for this run (paths may move; whether a
# random base is allowed is a check, not a shape).
_MODEL_KEYS_IGNORED = {"hf_path", "tokenizer", "init_path", "name", "allow_random_base"}
_PEFT_SHAPE_KEYS = ("r", "target_modules")  # what sets the adapters' tensors
# Not compared: the layout (resharded on load), where and how the run is launched, the checkpoint
# settings themselves, and the command line as typed (its effect is in the other keys).
_NOT_COMPARED = ("run.dir", "run.id", "run.overrides", "run.max_time", "run.stop_file",
                 "run.handle_signals", "launcher.", "parallel.", "checkpoint.")  # fmt: skip
# data.* keys that do not decide which rows the stream holds (the rest do).
_DATA_KEYS_FREE = {"data.trim_padding", "data.val_path", "data.cache_dir", "data.tokenize_workers"}


def stream_key(key: str) -> bool:
    """A key whose change makes the saved data position point into another stream of rows."""
    return key == "run.seed" or (key.startswith("data.") and key not in _DATA_KEYS_FREE)


def check_compatible(state, common: dict, path) -> list[str]:
    """Refuse a checkpoint of another model or PEFT mode before megatron fails obscurely, and a
    changed data stream unless allowed. Returns the changed stream keys that were allowed (the
    caller then starts the data from its beginning)."""
    # data, never resolved: an `${oc.env:...}` in it would print your secret in the messages below
    saved = safe_files.run_config(str(common["config"]), f"{path}/common.pt (its config)",
                                  "checkpoint.resume")  # fmt: skip
    now = state.cfg
    diffs = [
        f"model.{k}: {saved.model.get(k)} -> {now.model.get(k)}"
        for k in now.model
        if k not in _MODEL_KEYS_IGNORED and saved.model.get(k) != now.model.get(k)
    ]
    if diffs:
        raise FtcoreError(
            f"checkpoint {path} was saved for another model ({'; '.join(diffs)})",
            field="checkpoint.resume",
            fix="resume with the model it was saved with, or checkpoint.resume=never / another run.dir",
        )
    if bool(common["adapter_only"]) != (now.peft.name != "none"):
        kind = "an adapter-only (PEFT)" if common["adapter_only"] else "a full"
        raise FtcoreError(
            f"checkpoint {path} is {kind} checkpoint but this run has peft.name={now.peft.name}",
            field="peft.name",
            fix="resume with the peft settings it was saved with",
        )
    if now.peft.name != "none":  # a smaller rank would load a slice of each saved adapter, silently
        shape = [f"peft.{k}: {saved.peft.get(k)} -> {now.peft.get(k)}" for k in _PEFT_SHAPE_KEYS
                 if saved.peft.get(k) != now.peft.get(k)]  # fmt: skip
        if shape:
            raise FtcoreError(
                f"checkpoint {path} holds adapters of another shape ({'; '.join(shape)})",
                field="peft",
                fix="resume with the peft settings it was saved with, or another run.dir",
            )
    step = common.get("step", 0)
    if now.train.max_steps < step:
        raise FtcoreError(
            f"train.max_steps={now.train.max_steps} is below the step of checkpoint {path} "
            f"({step}): the run would end without a step, with that checkpoint's weights",
            field="train.max_steps",
            fix=f"train.max_steps >= {step}, or checkpoint.resume=<an earlier step_N> / a new run.dir",
        )
    old, new = OmegaConf.to_container(saved), OmegaConf.to_container(now, resolve=True)
    changed = [k for k in changed_keys(old, new) if not k.startswith(_NOT_COMPARED)]
    stream = [k for k in changed if stream_key(k)]
    allowed = set(now.checkpoint.allow_changed)
    refused = [k for k in stream if k not in allowed and k.split(".")[0] not in allowed]
    if refused:
        names = ", ".join(f"{k} ({_value(old, k)} -> {_value(new, k)})" for k in refused)
        raise FtcoreError(
            f"checkpoint {path} (step {step}) was saved reading another data stream: {names}; "
            "its data position means nothing in the new one",
            field=refused[0],
            fix="a new run.dir to train on it from the start, or "
            f"'checkpoint.allow_changed=[{','.join(refused)}]' to continue this run from step "
            f"{step} reading the new data from its beginning",
        )
    if changed and state.info.rank == 0:
        log.warning("resuming step %s with settings that differ from its checkpoint's, applied from "
                    "here on: %s", step, "; ".join(f"{k} {_value(old, k)} -> {_value(new, k)}"
                                                  for k in changed))  # fmt: skip
        if stream:
            log.warning("checkpoint.allow_changed=%s: the data is read from its beginning",
                        ",".join(stream))  # fmt: skip
    return stream


def changed_keys(a, b, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain config trees."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += changed_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _value(tree: dict, key: str):
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return "unset" if tree is None else tree
