"""Issue 51, items 7 and 8: the record limits hold for every format, and any parse error of a
record is a bad record. A small Parquet file whose one row expands past the limit is a bad record,
found from the file's metadata (never decoded) and nothing is written to any cache; a row over the
limit inside a larger row group is measured in Arrow before it becomes Python; a 5,000-digit
number in a JSONL line (or in a JSON array) is a bad record (skipped with data.on_bad_record=skip:
test_sources.py's BAD["huge_number"])."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ftcore.data import sources
from ftcore.data.sources import RecordError, iter_records

GOOD = {"instruction": "What is 1 + 2?", "output": "3"}


def _records(path: Path) -> list[tuple[str, object]]:
    return list(iter_records([path]))


def _no_cache_writes(tmp_path: Path, monkeypatch) -> Path:
    """Where `datasets` (and anything else) would cache, moved under tmp_path."""
    import sys

    caches = tmp_path / "caches"
    for var, sub in (
        ("HF_HOME", "hf"),
        ("HF_DATASETS_CACHE", "hf_datasets"),
        ("XDG_CACHE_HOME", "xdg"),
    ):
        monkeypatch.setenv(var, str(caches / sub))
    if "datasets" in sys.modules:  # already imported: its cache directory was read then
        monkeypatch.setattr(
            sys.modules["datasets"].config, "HF_DATASETS_CACHE", str(caches / "hf_datasets")
        )
    return caches


def test_an_expanding_parquet_row_is_a_bad_record_never_decoded(tmp_path, monkeypatch):
    """The attack's shape, scaled down 64x (limit 1 MiB, a row of 3 MiB in a file of ~1 KB; the
    attack: 18 KB to 200 MB against 64 MiB): the row is a bad record from the row group's size in
    the footer, its row group is never decoded, and no cache is written (the attack wrote 201 MB
    under ~/.cache/huggingface/datasets)."""
    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 1 << 20)
    caches = _no_cache_writes(tmp_path, monkeypatch)
    f = tmp_path / "bomb.parquet"
    schema = pa.schema([("instruction", pa.string()), ("output", pa.string())])
    with pq.ParquetWriter(f, schema, compression="zstd") as writer:
        writer.write_table(pa.table({"instruction": [GOOD["instruction"]], "output": ["3"]}))
        writer.write_table(pa.table({"instruction": ["x" * (3 << 20)], "output": ["4"]}))
        writer.write_table(pa.table({"instruction": [GOOD["instruction"]], "output": ["5"]}))
    assert f.stat().st_size < 4096
    decoded = []
    real = pq.ParquetFile.iter_batches
    monkeypatch.setattr(pq.ParquetFile, "iter_batches",
                        lambda self, *a, **k: decoded.append(k["row_groups"]) or real(self, *a, **k))  # fmt: skip
    got = _records(f)
    assert [w.rsplit(":", 1)[1] for w, _ in got] == ["row 1", "row 2", "row 3"]
    assert got[0][1] == GOOD and got[2][1]["output"] == "5"
    assert isinstance(got[1][1], RecordError) and "longer than" in str(got[1][1])
    assert decoded == [[0], [2]]  # the big row's group was never decoded
    assert not caches.exists() or not any(p.is_file() for p in caches.rglob("*"))


def test_a_large_row_among_others_is_measured_before_it_becomes_python(tmp_path, monkeypatch):
    """A row over the limit in a row group with others is decoded in Arrow only, and refused."""
    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 1 << 20)
    f = tmp_path / "mixed.parquet"
    big = {"instruction": "y" * (2 << 20), "output": "1"}
    pq.write_table(pa.Table.from_pylist([GOOD, big, GOOD]), f, compression="zstd")
    assert pq.ParquetFile(f).metadata.num_row_groups == 1
    got = [rec for _, rec in _records(f)]
    assert got[0] == GOOD and got[2] == GOOD and isinstance(got[1], RecordError)


def test_save_to_disk_rows_obey_the_limits_and_stay_inside(tmp_path, monkeypatch):
    """A `save_to_disk` directory is read with pyarrow: the same limits, and the files its
    state.json names stay inside the directory."""
    from datasets import Dataset

    from ftcore.errors import FtcoreError

    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 1 << 20)
    d = tmp_path / "saved"
    Dataset.from_list([GOOD, {"instruction": "z" * (2 << 20), "output": "1"}]).save_to_disk(str(d))
    got = [rec for _, rec in _records(d)]
    assert got[0] == GOOD and isinstance(got[1], RecordError)
    state = json.loads((d / "state.json").read_text())
    state["_data_files"] = [{"filename": str(tmp_path / "elsewhere.arrow")}]
    (d / "state.json").write_text(json.dumps(state))
    with pytest.raises(FtcoreError, match=r"data\.path: .*state\.json names .*outside"):
        _records(d)


DIGITS = "9" * 5000


def test_a_5000_digit_number_is_a_bad_record(tmp_path):
    """Python's int parser refuses it with a ValueError that is not a JSONDecodeError (the attack
    crashed the run with exit 1 even with on_bad_record=skip)."""
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + f'{{"instruction": "x", "output": {DIGITS}}}\n'
                 + json.dumps(GOOD) + "\n")  # fmt: skip
    got = _records(f)
    assert got[0][1] == GOOD and got[2][1] == GOOD
    assert isinstance(got[1][1], RecordError) and got[1][0].endswith(":2")
    arr = tmp_path / "d.json"  # the same inside a JSON array, and as a bare element
    arr.write_text(f'[{json.dumps(GOOD)}, {{"output": {DIGITS}}}, {DIGITS}, {json.dumps(GOOD)}]')
    got = [rec for _, rec in _records(arr)]
    assert got[0] == GOOD and got[3] == GOOD and all(isinstance(r, RecordError) for r in got[1:3])
