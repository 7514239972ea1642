"""What a file from elsewhere holds, read as data: JSON, a run's YAML config, tensors, tokenizers.

- JSON: any parse error (syntax, a 5,000-digit integer, nesting too deep) is an FtcoreError
  naming the file, never a crash.
- A run's config (a checkpoint's config.yaml, the YAML inside common.pt): YAML's safe subset with
  no aliases, then no OmegaConf interpolation at all (`${...}` would resolve `oc.env`, i.e. read
  your environment's secrets into whatever the config is written to): a value holding one is
  refused, except where it equals the schema's own default (ftcore's, not the file's); then
  merged onto the schema (ftcore/config/groups.py), so an unknown key or a wrong type is refused.
- Tensors: torch.load with weights_only=True passed explicitly (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
  in the environment overrides only a call that does not pass it), on CPU; safetensors through
  its own reader (no code), from a path checked like any other.
- Tokenizers: transformers, from a local directory only (never the Hub), never its code.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ftcore.errors import FtcoreError
from ftcore.runtime.safe_files.paths import MAX_READ_BYTES, inside, open_read, read_text


def parse_json(text: str | bytes, where: str, field: str) -> object:
    """JSON text as data; any error is an FtcoreError naming `where`."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, too many digits, too deep
        raise FtcoreError(f"{where} is not valid JSON ({type(e).__name__}: {str(e)[:200]})",
                          field=field, fix="restore the file as its writer wrote it") from None  # fmt: skip


def read_json(
    path: Path, field: str, *, root: Path | None = None, limit: int = MAX_READ_BYTES
) -> object:
    return parse_json(read_text(path, field, root=root, limit=limit), str(path), field)


def read_json_object(path: Path, field: str, *, root: Path | None = None) -> dict:
    """read_json of a file that must hold a JSON object."""
    data = read_json(path, field, root=root)
    if not isinstance(data, dict):
        raise FtcoreError(f"{path} holds a JSON {type(data).__name__}, not an object", field=field,
                          fix="restore the file as its writer wrote it")  # fmt: skip
    return data


# ------------------------------------------------------------------------- a run's config


def _yaml_data(text: str, where: str, field: str) -> dict:
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):  # an alias could expand a small file enormously
            if self.check_event(yaml.AliasEvent):
                raise yaml.YAMLError("it uses a YAML alias (*name), which a run config never holds")
            return super().compose_node(parent, index)

    try:
        data = yaml.load(text, Loader=NoAliases)  # noqa: S506 - a SafeLoader: data only
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        raise FtcoreError(f"{where} is not a readable run config ({type(e).__name__}: {str(e)[:200]})",
                          field=field, fix="use the config.yaml ftcore wrote with the run") from None  # fmt: skip
    if not isinstance(data, dict):
        raise FtcoreError(f"{where} is not a run config (it holds a {type(data).__name__})", field=field,
                          fix="use the config.yaml ftcore wrote with the run")  # fmt: skip
    return data


def _strip_interpolations(data, defaults, where: str, field: str, key: str = "") -> None:
    """Refuse every `${...}` in `data` (in place), except one equal to the schema's own default
    at that key, which is dropped so the schema's stays."""
    items = (
        data.items()
        if isinstance(data, dict)
        else enumerate(data)
        if isinstance(data, list)
        else ()
    )
    for k, v in list(items):
        name = f"{key}.{k}" if key else str(k)
        default = defaults.get(k) if isinstance(defaults, dict) else None
        if isinstance(v, str) and "${" in v:
            if v == default and isinstance(data, dict):
                del data[k]
                continue
            raise FtcoreError(
                f"{where}: {name} holds an interpolation ({v[:80]}): a config from elsewhere is "
                "read as data and never resolved (it could read your environment's secrets)",
                field=field,
                fix=f"write the value itself into {name}, or export a checkpoint ftcore saved",
            )
        _strip_interpolations(v, default, where, field, name)


def run_config(text: str, where: str, field: str):
    """A run's config (YAML text) as a DictConfig checked against the schema, no interpolation."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ftcore.config.groups import FtcoreConfig

    data = _yaml_data(text, where, field)
    schema = OmegaConf.structured(FtcoreConfig)
    _strip_interpolations(data, OmegaConf.to_container(schema), where, field)
    try:
        return OmegaConf.merge(schema, data)
    except (OmegaConfBaseException, ValueError, TypeError, AttributeError, KeyError) as e:
        raise FtcoreError(f"{where} does not fit ftcore's config schema ({str(e).splitlines()[0][:300]})",
                          field=field, fix="use the config.yaml written with the run, by this ftcore") from None  # fmt: skip


def read_run_config(path: Path, field: str, *, root: Path | None = None):
    return run_config(read_text(path, field, root=root), str(path), field)


# ---------------------------------------------------------------------------------- tensors


def torch_load(path: Path, field: str, *, root: Path | None = None):
    """torch.load of a file from elsewhere: weights_only=True (explicit), on CPU."""
    with open_read(path, field, root=root) as f:
        return load_tensors(f, str(path), field)


def load_tensors(f, where: str, field: str):
    """torch.load(weights_only=True) of an open file or buffer; refusal -> FtcoreError."""
    import torch

    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any object torch's safe loader refuses, or a bad file
        raise FtcoreError(
            f"{where} is not plain data ({type(e).__name__}: {str(e)[:200]}); it was not loaded",
            field=field,
            fix="load only files you or ftcore wrote (safetensors where there is a choice)",
        ) from None


@contextlib.contextmanager
def safetensors_open(path: Path, field: str, *, root: Path | None = None, framework: str = "pt"):
    """safetensors' `safe_open` of a file checked as `open_read` checks it (inside `root`, a
    regular file), opened at its resolved path."""
    from safetensors import SafetensorError, safe_open

    open_read(path, field, root=root).close()
    try:
        handle = safe_open(str(Path(path).resolve()), framework=framework)
    except (SafetensorError, OSError) as e:
        raise FtcoreError(f"{path} is not a readable safetensors file ({e})", field=field,
                          fix="re-download or re-save the file") from None  # fmt: skip
    with handle as f:
        yield f


def load_safetensors(path: Path, field: str, *, root: Path | None = None) -> dict:
    """Every tensor of a safetensors file (torch), checked as `safetensors_open` checks it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    open_read(path, field, root=root).close()
    try:
        return load_file(str(Path(path).resolve()))
    except (SafetensorError, OSError) as e:
        raise FtcoreError(f"{path} is not a readable safetensors file ({e})", field=field,
                          fix="re-download or re-save the file") from None  # fmt: skip


# ------------------------------------------------------------------------------- tokenizers


def tokenizer(directory: Path, field: str, *, fast: bool = False):
    """A transformers tokenizer from a local directory whose files all stay inside it; `fast`:
    PreTrainedTokenizerFast directly (ftcore's bundled one), else AutoTokenizer, never its code."""
    import transformers

    for p in Path(directory).iterdir():
        inside(directory, p.name, field, what=f"{directory} holds a link that")
    if fast:
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
