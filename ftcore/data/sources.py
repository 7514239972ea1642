"""Where records come from: JSONL/JSON/CSV/Parquet files, directories of them, and Hugging Face
datasets.

Every record comes with where it was found ("file:line" or "file:row"), so a bad one can be named.
JSON and JSONL are parsed here line by line (a malformed line or invalid UTF-8 is reported with its
line number, which Arrow's JSON reader cannot do); CSV by the standard library's reader, row by
row, every cell a string. Parquet and `save_to_disk` directories are read with pyarrow, one batch
of rows at a time, writing nothing anywhere; datasets in the local Hugging Face cache go through
`datasets`, offline. Files are opened through ftcore's one door (ftcore/runtime/safe_files); the
record limits below hold for every format: an Arrow row is measured before it becomes Python, and
a Parquet row group of one row by the file's metadata, before it is decoded.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# Bounds on one record (docs/data.md): beyond them it is a bad record (skipped and counted with
# data.on_bad_record=skip), never a crash and never held whole in memory.
MAX_RECORD_BYTES = 64 << 20  # 64 MiB: ~16M tokens of text, far beyond any seq_len
MAX_DEPTH = 64  # lists/objects inside one another; chat records nest 3 deep
ARROW_BATCH_ROWS = 256  # Parquet/Arrow rows decoded at a time


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
                fix="point it at a directory with .jsonl, .json, .csv or .parquet files",
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
            yield from _nonempty(f, _disk_rows(f))
        elif f.suffix == ".parquet":
            yield from _nonempty(f, _parquet_rows(f))
        elif f.suffix == ".csv":
            yield from _csv_records(f)
        else:
            yield from _json_records(f)


def _json_records(f: Path) -> Iterator[tuple[str, object]]:
    """JSONL read line by line (never the whole file at once, so a file larger than memory
    streams, and never a whole line longer than MAX_RECORD_BYTES); a `.json` file holding an
    array is parsed whole (_json_array)."""
    with safe_files.open_read(f, "data.path") as fh:
        head = fh.read(4096)
        if f.suffix == ".json" and head.lstrip()[:1] == b"[":
            yield from _json_array(f, head + fh.read())
            return
        fh.seek(0)
        seen, n = False, 0
        while raw := fh.readline(MAX_RECORD_BYTES + 1):
            n += 1
            seen, where = seen or bool(raw.strip()), f"{f}:{n}"
            if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
                for piece in iter(lambda: fh.readline(1 << 20), b""):  # never held whole
                    if piece.endswith(b"\n"):
                        break  # the end of the oversized line
                yield where, RecordError(where, _too_large())
                continue
            try:
                line = raw.rstrip(b"\n").decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, RecordError(where, f"invalid UTF-8 at byte {e.start} of the line")
                continue
            if not line.strip():
                continue
            yield where, _parse(where, line)
    if not seen:
        raise FtcoreError(
            f"{f} is empty", field="data.path", fix="give a file with at least one record"
        )


def _csv_records(f: Path) -> Iterator[tuple[str, object]]:
    """A CSV file whose header row names the fields (instruction,output / prompt,completion /
    text / prompt,chosen,rejected ...): one record per row, each cell a string as written (no
    type guessing: an answer "4" stays text), an empty cell an absent field. A row with more cells
    than the header, or a cell beyond MAX_RECORD_BYTES, is a bad record."""
    import csv

    csv.field_size_limit(MAX_RECORD_BYTES)
    with io.TextIOWrapper(safe_files.open_read(f, "data.path"), encoding="utf-8", newline="") as fh:
        try:
            rows = csv.reader(fh)
            header = next(rows, None)
            if header is None:
                raise FtcoreError(f"{f} is empty", field="data.path",
                                  fix="give a CSV file with a header row and at least one record")  # fmt: skip
            seen, line = False, rows.line_num + 1
            while True:
                where = f"{f}:{line}"
                try:
                    cells = next(rows)
                except StopIteration:
                    break
                except csv.Error as e:
                    yield where, RecordError(where, f"unreadable CSV row: {e}")
                    line = rows.line_num + 1
                    continue
                line = rows.line_num + 1
                if not any(c.strip() for c in cells):
                    continue
                seen = True
                if len(cells) > len(header):
                    yield (
                        where,
                        RecordError(where, f"{len(cells)} cells under a header of {len(header)}"),
                    )
                    continue
                yield where, {k: v for k, v in zip(header, cells) if v != ""}
        except UnicodeDecodeError as e:
            raise FtcoreError(f"{f}: invalid UTF-8 ({e.reason})", field="data.path",
                              fix="re-encode the file as UTF-8") from None  # fmt: skip
    if not seen:
        raise FtcoreError(f"{f} holds a header but no records", field="data.path",
                          fix="give a CSV file with at least one record")  # fmt: skip


def _too_large() -> str:
    return f"record longer than {MAX_RECORD_BYTES} bytes (ftcore's limit per record)"


def _parse(where: str, text: str) -> object:
    """One JSON record, or the RecordError that says why not (malformed, too deep)."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        return RecordError(where, f"malformed JSON: {e.msg} (column {e.colno})")
    except RecursionError:
        return RecordError(where, _too_deep())
    except ValueError as e:  # any other parse error of one record: a number of 5,000 digits
        return RecordError(where, f"unreadable JSON: {str(e)[:200]}")
    return RecordError(where, _too_deep()) if _deeper_than(rec, text, MAX_DEPTH) else rec


def _too_deep() -> str:
    return f"record nested deeper than {MAX_DEPTH} levels (ftcore's limit)"


def _deeper_than(rec: object, text: str, limit: int) -> bool:
    """Whether `rec` nests lists/objects more than `limit` deep (only walked when its text holds
    that many brackets, so ordinary records cost one count)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    level = [rec] if isinstance(rec, (list, dict)) else []  # the containers at depth 1, 2, ...
    for _ in range(limit):
        level = [
            c
            for x in level
            for c in (x.values() if isinstance(x, dict) else x)
            if isinstance(c, (list, dict))
        ]
        if not level:
            return False
    return True


_VALUE_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


_NUMBER = re.compile(r"-?[0-9.eE+-]+")


def _skip_value(text: str, pos: int) -> int:
    """The end of the JSON value starting at `pos` by bracket depth (strings skipped), for a
    value that cannot be decoded; len(text) if it never closes."""
    if text[pos : pos + 1] not in ("[", "{"):  # a bare value: a number (of 5,000 digits) or string
        m = _VALUE_TOKEN.match(text, pos) or _NUMBER.match(text, pos)
        return m.end() if m else len(text)
    depth = 0
    for m in _VALUE_TOKEN.finditer(text, pos):
        c = m.group()
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        if depth <= 0:
            return m.end()
    return len(text)


def _json_array(f: Path, data: bytes) -> Iterator[tuple[str, object]]:
    """A JSON array of records, decoded element by element in one pass (each element's line is
    counted from the previous one: linear in the file); a syntax error stops the file before any
    record is used (nothing after it can be trusted); an element too deep or too large is a bad
    record, as a JSONL line would be."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise FtcoreError(
            f"{f}:{line}: invalid UTF-8", field="data.path", fix="re-encode the file as UTF-8"
        ) from None

    def malformed(lineno: int, msg: str) -> FtcoreError:
        return FtcoreError(
            f"{f}:{lineno}: malformed JSON: {msg}", field="data.path", fix="fix the file"
        )

    dec, out = json.JSONDecoder(), []
    pos, line, counted = text.index("[") + 1, 1, 0
    space = re.compile(r"[ \t\r\n]*")
    pos = space.match(text, pos).end()
    if text.startswith("]", pos):
        pos += 1
    else:
        while True:
            line += text.count("\n", counted, pos)
            counted, where = pos, f"{f}:{line}"
            try:
                rec, end = dec.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                raise malformed(e.lineno, e.msg) from None
            except RecursionError:
                rec, end = RecordError(where, _too_deep()), _skip_value(text, pos)
            except ValueError as e:  # not a syntax error: a number of 5,000 digits
                rec, end = (
                    RecordError(where, f"unreadable JSON: {str(e)[:200]}"),
                    _skip_value(text, pos),
                )
            if end - pos > MAX_RECORD_BYTES:
                rec = RecordError(where, _too_large())
            elif not isinstance(rec, RecordError) and _deeper_than(rec, text[pos:end], MAX_DEPTH):
                rec = RecordError(where, _too_deep())
            out.append((where, rec))
            pos = space.match(text, end).end()
            if text.startswith(",", pos):
                pos = space.match(text, pos + 1).end()
            elif text.startswith("]", pos):
                pos += 1
                break
            else:
                lineno = line + text.count("\n", counted, pos)
                raise malformed(lineno, "expected ',' or ']' after a record")
    if text[pos:].strip():
        raise malformed(line + text.count("\n", counted, pos), "extra data after the array")
    yield from out


def _nonempty(f, rows: Iterator[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    empty = True
    for item in rows:
        empty = False
        yield item
    if empty:
        raise FtcoreError(
            f"{f} is empty", field="data.path", fix="give a data set with at least one record"
        )


def _arrow_rows(f, batches, first: int = 1) -> Iterator[tuple[str, object]]:
    """The rows of Arrow record batches as Python records, numbered from `first`; a row larger than
    MAX_RECORD_BYTES (measured in Arrow, before it becomes Python) is a bad record."""
    n = first
    for batch in batches:
        big = batch.nbytes > MAX_RECORD_BYTES  # else no row of it can be: converted at once
        rows = None if big else batch.to_pylist()
        for i in range(batch.num_rows):
            where = f"{f}:row {n}"
            n += 1
            if not big:
                yield where, rows[i]
            elif (row := batch.slice(i, 1)).nbytes > MAX_RECORD_BYTES:
                yield where, RecordError(where, _too_large())
            else:
                yield where, row.to_pylist()[0]


def split_note(path: str) -> str | None:
    """For a `save_to_disk` DatasetDict, which split training reads and how to take another (the
    log line of tokenized.tokenize_source)."""
    d = Path(path).expanduser()
    if not (d / "dataset_dict.json").is_file():
        return None
    try:
        splits = safe_files.read_json_object(d / "dataset_dict.json", "data.path", root=d).get(
            "splits"
        )
    except FtcoreError:
        return None  # the read itself (_disk_rows) says what is wrong
    if not isinstance(splits, list) or len(splits) < 2:
        return None
    other = next(str(s) for s in splits if s != "train")
    return (f"data {d} is a DatasetDict of splits {', '.join(map(str, splits))}: its train split "
            f"is read (another split is its own directory: e.g. data.path={d / other})")  # fmt: skip


def _parquet_rows(f: Path) -> Iterator[tuple[str, object]]:
    """A Parquet file, one row group and one batch at a time. A row group of one row larger than
    MAX_RECORD_BYTES (its size in the file's metadata) is a bad record and is never decoded."""
    import pyarrow.parquet as pq

    with safe_files.open_read(f, "data.path") as fh:
        try:
            pf = pq.ParquetFile(fh)
            n = 1
            for g in range(pf.metadata.num_row_groups):
                group = pf.metadata.row_group(g)
                if group.num_rows == 1 and group.total_byte_size > MAX_RECORD_BYTES:
                    yield f"{f}:row {n}", RecordError(f"{f}:row {n}", _too_large())
                else:
                    batches = pf.iter_batches(ARROW_BATCH_ROWS, row_groups=[g], use_threads=False)
                    yield from _arrow_rows(f, batches, n)
                n += group.num_rows
        except (OSError, ValueError, TypeError, NotImplementedError) as e:  # pyarrow's errors
            raise FtcoreError(f"{f}: cannot read Parquet: {str(e)[:300]}", field="data.path",
                              fix="check the file") from None  # fmt: skip


def _disk_rows(d: Path) -> Iterator[tuple[str, object]]:
    """A `save_to_disk` directory (its `train` split, for a DatasetDict): the Arrow stream files
    its state.json lists, each inside the directory, read batch by batch."""
    import pyarrow as pa

    field, top = "data.path", d
    if (d / "dataset_dict.json").is_file():
        splits = safe_files.read_json_object(d / "dataset_dict.json", field, root=d).get("splits")
        if not isinstance(splits, list) or "train" not in splits:
            raise FtcoreError(f"{d} holds no train split", field=field,
                              fix="save the data set with a train split, or point at it")  # fmt: skip
        d = safe_files.inside(d, "train", field, what=str(d / "dataset_dict.json"))
    state = safe_files.read_json_object(d / "state.json", field, root=d)
    names = [e.get("filename") for e in state.get("_data_files") or [] if isinstance(e, dict)]
    n = 1
    for name in names:
        path = safe_files.inside(d, str(name), field, what=str(d / "state.json"))
        with safe_files.open_read(path, field, root=d) as fh:
            try:
                reader = pa.ipc.open_stream(fh)
                for where, rec in _arrow_rows(top, reader, n):
                    n += 1
                    yield where, rec
            except (OSError, ValueError, TypeError, NotImplementedError) as e:
                raise FtcoreError(f"{path}: cannot read Arrow: {str(e)[:300]}", field=field,
                                  fix="save the data set again (datasets' save_to_disk)") from None  # fmt: skip


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
    """Rows of a data set in the local Hugging Face cache (memory-mapped by `datasets`)."""
    table = _hf_dataset(name).data.table
    yield from _nonempty(name, _arrow_rows(name, table.to_batches(ARROW_BATCH_ROWS)))
