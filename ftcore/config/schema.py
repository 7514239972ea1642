"""How a run's config is composed: Hydra merges the YAML files of `conf/` into the schema's
dataclasses (ftcore.config.groups), so an unknown key or a wrong type fails at compose time with
the key's name. `compose()` maps Hydra's errors to FtcoreError (exit 2). Semantic checks live in
`ftcore.validation.checks`, which runs them in the pinned order.
"""

from __future__ import annotations

import difflib
import importlib.resources
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ftcore.config.groups import FtcoreConfig
from ftcore.errors import FtcoreError


def conf_dir() -> Path:
    """The conf/ directory, shipped inside the installed package as `ftcore.conf`."""
    return Path(str(importlib.resources.files("ftcore.conf")))


def assets_dir() -> Path:
    return Path(str(importlib.resources.files("ftcore.assets")))


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="ftcore_schema", node=FtcoreConfig)


HYDRA_INFO = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def compose(overrides: list[str], info: str | None = None) -> DictConfig | None:
    """Compose conf/config.yaml with command-line overrides; Hydra errors become FtcoreError.
    With `info` (one of HYDRA_INFO): print what Hydra's `--info INFO` prints instead, return None."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            if info is not None:
                logging.getLogger().handlers.clear()  # Hydra logs it to stdout, once
                GlobalHydra.instance().hydra.show_info(info, "config", list(overrides))
                return None
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
    # OmegaConf re-raises some merge errors as the builtin type with the key attached (a dict
    # merged into a null section: AttributeError; a key set under one: AssertionError): all of
    # them are about the user's overrides
    except (
        HydraException,
        OmegaConfBaseException,
        ValueError,
        AttributeError,
        AssertionError,
        TypeError,
        KeyError,
    ) as e:
        raise FtcoreError(*_unparsable(e, overrides) or (_one_line_hydra_error(e),),
                          fix=_fix_for(e, overrides)) from e  # fmt: skip
    finally:
        GlobalHydra.instance().clear()
    OmegaConf.set_struct(cfg, True)
    cfg.run.overrides = [str(o) for o in overrides]
    _check_epochs(cfg, overrides)
    return cfg


def _check_epochs(cfg: DictConfig, overrides: list[str]) -> None:
    """train.epochs and train.max_steps both given by the user is a contradiction (a preset's
    max_steps is not: the trainer derives it from epochs and the data size)."""
    epochs = cfg.train.epochs
    if epochs is None:
        return
    if epochs <= 0:
        raise FtcoreError(f"epochs must be > 0, not {epochs}", field="train.epochs",
                          fix="train.epochs=1 (or any number > 0)")  # fmt: skip
    if any(o.lstrip("+~").startswith("train.max_steps=") for o in overrides):
        raise FtcoreError("both train.epochs and train.max_steps are given", field="train.epochs",
                          fix="give one: the step count is derived from epochs and the data size")  # fmt: skip


def _bad_override(e: BaseException, overrides: list[str]) -> str | None:
    """The override Hydra's parser could not read (an apostrophe, a comma, a bracket), if that is
    the error."""
    from hydra.errors import OverrideParseException

    if not isinstance(e, OverrideParseException):
        return None
    return next((o for o in overrides if o and o in str(e)), None)


def _unparsable(e: BaseException, overrides: list[str]) -> tuple[str] | None:
    bad = _bad_override(e, overrides)
    if bad is None:
        return None
    key = bad.lstrip("+~").split("=", 1)[0]
    return (f"{key}: Hydra's override parser cannot read {bad!r} ({type(e).__name__})",)


def _fix_for(e: BaseException, overrides: list[str]) -> str:
    """How to pass a value Hydra's parser cannot read; a prompt goes in a file. Any other error:
    check it against conf/."""
    bad = _bad_override(e, overrides)
    if bad is None:
        return "check the key and value against conf/"
    key = bad.lstrip("+~").split("=", 1)[0]
    if key == "generate.prompt":
        return ("a prompt with quotes or commas goes in a file: generate.prompt_file=prompt.txt "
                "(or generate.prompt_file=- to read standard input; docs/quickstart.md)")  # fmt: skip
    return (f"quote the value for Hydra inside the shell's quotes: '{key}=\"...\"' (an apostrophe "
            "inside: docs/quickstart.md), or a file where the key takes one")  # fmt: skip


def _one_line_hydra_error(e: BaseException) -> str:
    """Hydra's errors span many lines; keep the key and the reason on one."""
    while e.__cause__ is not None and not getattr(e, "full_key", None):
        e = e.__cause__
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()] or [type(e).__name__]
    key = getattr(e, "full_key", None) or next(
        (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None
    )  # OmegaConf's re-raised builtin errors carry the key in their text only
    msg = lines[0]
    if "Could not find" in msg:
        options = [ln for ln in lines[2:] if not ln.startswith(("Config search", "provider="))]
        msg += f" (options: {', '.join(options)})" if options else ""
    nearest = nearest_key(key) if key and "not in" in msg else None
    msg += f" (did you mean {nearest}?)" if nearest else ""
    return f"{key}: {msg}" if key else f"config error: {msg}"


def nearest_key(full_key: str) -> str | None:
    """The schema key closest to a mistyped one (`peft.rank` -> `peft.r`): the first unknown part
    of the dotted key is matched (difflib, plus a bonus for a shared prefix) against its section."""
    node, parts = OmegaConf.structured(FtcoreConfig), full_key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        keys = [str(k) for k in node.keys()]
        if part not in keys:
            best = max(keys, key=lambda k: _likeness(part, k), default=None)
            if best is None or _likeness(part, best) < 0.6:
                return None
            return ".".join([*parts[:i], best])
        node = node._get_node(part)
    return None


def _likeness(typed: str, key: str) -> float:
    prefix = key.startswith(typed) or typed.startswith(key)  # `rank` for `r`, `max_step` for ...
    return difflib.SequenceMatcher(None, typed, key).ratio() + (0.3 if prefix else 0.0)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)
