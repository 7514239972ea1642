"""Which tokenizer a run uses: model.tokenizer, else model.hf_path, else the bundled tiny one."""

from __future__ import annotations

from pathlib import Path

from ftcore.config.schema import assets_dir
from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files


def bundled_tokenizer_dir() -> Path:
    return assets_dir() / "tokenizer"


def tokenizer_source(cfg) -> tuple[str, str]:
    """(directory, the config field it came from)."""
    if cfg.model.get("tokenizer"):
        return str(cfg.model.tokenizer), "model.tokenizer"
    if cfg.model.get("hf_path"):
        return str(cfg.model.hf_path), "model.hf_path"
    return str(bundled_tokenizer_dir()), "model.tokenizer"


def from_directory(path, field: str = "model.tokenizer") -> object:
    """AutoTokenizer.from_pretrained(path), except for the bundled tokenizer: a
    PreTrainedTokenizerFast by its tokenizer_config.json, built as that class directly (the same
    object: tests/unit/data/test_tokenizer.py). AutoTokenizer first indexes every model package of
    transformers to resolve a class name (~1.3 s of CPU), in every process that loads one.
    Only a local directory (never a Hub id: nothing is downloaded), and never its own code."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FtcoreError(
            f"tokenizer {path} is not a local directory (a Hub name is never downloaded)",
            field=field,
            fix="a local Hugging Face directory holding tokenizer.json / tokenizer_config.json",
        )
    return safe_files.tokenizer(p, field, fast=p.resolve() == bundled_tokenizer_dir().resolve())


def load_tokenizer(cfg):
    """A transformers tokenizer with a pad token (the eos token when the tokenizer has none)."""
    path, field = tokenizer_source(cfg)
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FtcoreError(
            f"tokenizer directory {path} does not exist",
            field=field,
            fix="point it at a local Hugging Face directory holding tokenizer.json / tokenizer_config.json",
        )
    try:
        tok = from_directory(p)
    except FtcoreError:
        raise
    except Exception as e:  # transformers raises many types (OSError, ValueError, JSON errors)
        raise FtcoreError(
            f"cannot load a tokenizer from {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            field=field,
            fix="the directory needs tokenizer.json (or a sentencepiece model) and tokenizer_config.json",
        ) from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    # ftcore cuts documents at data.seq_len itself: the tokenizer's own model_max_length would
    # only make transformers warn ("Token indices sequence length is longer than the specified
    # maximum ...") about documents that ftcore then truncates or drops, and says so
    tok.model_max_length = NO_LIMIT
    return tok


NO_LIMIT = int(1e30)  # transformers' VERY_LARGE_INTEGER: "no maximum length"
