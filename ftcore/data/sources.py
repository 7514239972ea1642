"""Where records come from: JSONL/JSON/Parquet files, directories of them, and Hugging Face datasets.

Every record comes with where it was found ("file:line" or "file:row"), so a bad one can be named.
JSON and JSONL are parsed here line by line (a malformed line or invalid UTF-8 is reported with its
line number, which Arrow's JSON reader cannot do); Parquet, `save_to_disk` directories and datasets
in the local Hugging Face cache go through `datasets`, offline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ftcore.errors import FtcoreError

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class RecordError(ValueError):
    """A record (line) that cannot be read at all; `where` names the file and line."""

    def __init__(self, where: str, message: str):
        self.where = where
        super().__init__(message)

    def __reduce__(self):  # crosses to the tokenizing workers (render_pool.py) and back
        return RecordError, (self.where, str(self))


def resolve(path: str, field: str = "data.path") -> list[Path] | str:
    """A data path as its list of files, or a dataset name for the Hugging Face cache."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file():
            return [p]  # a `save_to_disk` directory, read as one dataset
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES)
        if not files:
            raise FtcoreError(
                f"directory {p} holds no data files ({', '.join(DATA_SUFFIXES)})",
                field=field,
                fix="point it at a directory with .jsonl, .json or .parquet files",
            )
        return files
    if not path.startswith((".", "/", "~")) and path.count("/") <= 1 and not p.suffix:
        return path  # looks like "org/name": a dataset in the local Hugging Face cache
    raise FtcoreError(
        f"{path} does not exist", field=field, fix="give an existing file or directory"
    )


def describe(files: list[Path] | str) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) per file (the files inside a `datasets` directory or cache entry):
    the cache key's view of the data."""
    if isinstance(files, str):
        paths = [Path(c["filename"]) for c in _hf_dataset(files).cache_files]
    else:
        paths = [
            g for f in files for g in (sorted(f.rglob("*")) if f.is_dir() else [f]) if g.is_file()
        ]
    out = []
    for f in paths:
        st = f.stat()
        out.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    return out


def iter_records(files: list[Path] | str) -> Iterator[tuple[str, object]]:
    """(where, record) for every record; a RecordError in place of a record that cannot be read."""
    if isinstance(files, str):
        yield from _hf_records(files)
        return
    for f in files:
        if f.is_dir():
            yield from _dataset_rows(f, _load_disk(f))
        elif f.suffix == ".parquet":
            yield from _dataset_rows(f, _load_parquet(f))
        else:
            yield from _json_records(f)


def _json_records(f: Path) -> Iterator[tuple[str, object]]:
    """JSONL read line by line (never the whole file at once, so a file larger than memory
    streams); a `.json` file holding an array is parsed whole (_json_array)."""
    with open(f, "rb") as fh:
        head = fh.read(4096)
        if f.suffix == ".json" and head.lstrip()[:1] == b"[":
            yield from _json_array(f, head + fh.read())
            return
        fh.seek(0)
        seen = False
        for n, raw in enumerate(fh, start=1):
            seen, where = seen or bool(raw.strip()), f"{f}:{n}"
            try:
                line = raw.rstrip(b"\n").decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, RecordError(where, f"invalid UTF-8 at byte {e.start} of the line")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, RecordError(where, f"malformed JSON: {e.msg} (column {e.colno})")
    if not seen:
        raise FtcoreError(
            f"{f} is empty", field="data.path", fix="give a file with at least one record"
        )


def _json_array(f: Path, data: bytes) -> Iterator[tuple[str, object]]:
    """A JSON array of records; a syntax error stops the file (nothing after it can be trusted)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise FtcoreError(
            f"{f}:{line}: invalid UTF-8", field="data.path", fix="re-encode the file as UTF-8"
        ) from None
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise FtcoreError(
            f"{f}:{e.lineno}: malformed JSON: {e.msg}", field="data.path", fix="fix the file"
        ) from None
    # Line of each element: decode the array element by element to learn where each one starts.
    dec, pos, lines = json.JSONDecoder(), text.index("[") + 1, []
    for _ in records:
        while text[pos] in " \t\r\n,":
            pos += 1
        lines.append(text.count("\n", 0, pos) + 1)
        _, pos = dec.raw_decode(text, pos)
    for line, rec in zip(lines, records):
        yield f"{f}:{line}", rec


def _dataset_rows(f, ds) -> Iterator[tuple[str, object]]:
    if len(ds) == 0:
        raise FtcoreError(
            f"{f} is empty", field="data.path", fix="give a data set with at least one record"
        )
    for i, row in enumerate(ds):
        yield f"{f}:row {i + 1}", row


def _load_parquet(f: Path):
    from datasets import Dataset

    try:
        return Dataset.from_parquet(str(f), keep_in_memory=True)
    except Exception as e:
        raise FtcoreError(
            f"{f}: cannot read Parquet: {e}", field="data.path", fix="check the file"
        ) from e


def _load_disk(f: Path):
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(str(f), keep_in_memory=True)
    return ds["train"] if isinstance(ds, DatasetDict) else ds


def _hf_dataset(name: str):
    """A dataset already in the local Hugging Face cache ("org/name" or "org/name:split"), offline."""
    import datasets

    repo, _, split = name.partition(":")
    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True  # never download: read what the cache holds
    try:
        return datasets.load_dataset(repo, split=split or "train")
    except Exception as e:
        raise FtcoreError(
            f"{name} is not a local path and not a data set in the local Hugging Face cache "
            f"({type(e).__name__})",
            field="data.path",
            fix="give a local file or directory, or download the data set first",
        ) from e
    finally:
        datasets.config.HF_HUB_OFFLINE = offline


def _hf_records(name: str) -> Iterator[tuple[str, object]]:
    yield from _dataset_rows(name, _hf_dataset(name))
