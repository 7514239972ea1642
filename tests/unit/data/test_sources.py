"""Sources and bad input: every bad case stops with an FtcoreError naming the file and line (exit 2
through the CLI), or is skipped and counted with data.on_bad_record=skip; JSON arrays, Parquet,
directories and `datasets` directories load; the tokenization cache is reused; nothing is written
to the run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ftcore.cli import main as cli_main
from ftcore.config.schema import compose
from ftcore.data import tokenized
from ftcore.data.pipeline import build_train_loader
from ftcore.data.tokenizer import load_tokenizer
from ftcore.errors import FtcoreError

GOOD_I = {"instruction": "What is 1 + 2?", "output": "3"}
GOOD_C = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(compose([]))


def cfg_for(tmp_path, path, *extra):
    return compose(
        [
            f"data.path={path}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.seq_len=64",
            "train.global_batch_size=2",
            "train.micro_batch_size=1",
            *extra,
        ]
    )


def lines(*records) -> bytes:
    out = b""
    for r in records:
        out += (r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n"
    return out


BAD = {
    "malformed_json": ("instruction", b'{"instruction": "x", "output": '),
    "missing_field": ("instruction", json.dumps({"instruction": "x"}).encode()),
    "non_string_content": (
        "chat",
        json.dumps(
            {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]}
        ).encode(),
    ),
    "non_string_output": ("instruction", json.dumps({"instruction": "x", "output": 3}).encode()),
    "unknown_role": (
        "chat",
        json.dumps(
            {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "a"}]}
        ).encode(),
    ),
    "no_assistant_turn": (
        "chat",
        json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
    ),
    "invalid_utf8": ("instruction", b'{"instruction": "caf\xe9", "output": "x"}'),
    "not_an_object": ("instruction", b'["instruction", "output"]'),
    "missing_text": ("text", json.dumps({"txt": "x"}).encode()),
    # issue 46: deeper than the JSON parser's recursion (RecursionError), and deeper than ftcore's 64
    "deeply_nested": (
        "instruction",
        b'{"instruction": "x", "output": "y", "z": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    ),  # fmt: skip
    "nested_65": (
        "instruction",
        b'{"instruction": "x", "output": "y", "z": ' + b"[" * 64 + b"]" * 64 + b"}",
    ),  # fmt: skip
    # issue 51: Python's int parser refuses 5,000 digits (a ValueError, not a JSONDecodeError)
    "huge_number": ("instruction", b'{"instruction": "x", "output": ' + b"9" * 5000 + b"}"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_record_names_file_and_line(tmp_path, tok, case):
    fmt, bad = BAD[case]
    good = GOOD_C if fmt == "chat" else ({"text": "hi"} if fmt == "text" else GOOD_I)
    f = tmp_path / "data.jsonl"
    f.write_bytes(lines(good, good, bad, good))  # the bad record is on line 3
    with pytest.raises(FtcoreError) as e:
        build_train_loader(cfg_for(tmp_path, f, f"data.format={fmt}"), tok, 0, 1)
    msg = str(e.value)
    assert f"{f}:3:" in msg and "data.on_bad_record=skip" in msg and "\n" not in msg
    ld = build_train_loader(
        cfg_for(tmp_path, f, f"data.format={fmt}", "data.on_bad_record=skip"), tok, 0, 1
    )
    assert ld.report["bad_records"] == 1 and ld.report["samples"] == 3


def test_skip_offered_only_where_it_would_keep_records(tmp_path, tok):
    """A chat file read as instruction data: every record is bad, and skipping them would train
    on nothing, so the fix points at the format instead."""
    f = tmp_path / "chat.jsonl"
    f.write_bytes(lines(GOOD_C, GOOD_C, GOOD_C))
    with pytest.raises(FtcoreError) as e:
        build_train_loader(cfg_for(tmp_path, f, "data.format=instruction"), tok, 0, 1)
    msg = str(e.value)
    assert 'missing field "instruction"' in msg and "data.on_bad_record=skip" not in msg
    assert "check data.format" in msg


def test_empty_file_and_empty_directory(tmp_path, tok):
    f = tmp_path / "empty.jsonl"
    f.write_text("\n \n")
    d = tmp_path / "nodata"
    d.mkdir()
    (d / "readme.txt").write_text("not data")
    for path, what in (
        (f, "is empty"),
        (d, "holds no data files"),
        (tmp_path / "nope.jsonl", "does not exist"),
    ):
        for policy in ("error", "skip"):
            with pytest.raises(FtcoreError, match=what):
                build_train_loader(
                    cfg_for(tmp_path, path, f"data.on_bad_record={policy}"), tok, 0, 1
                )


def test_all_records_bad_with_skip(tmp_path, tok):
    f = tmp_path / "d.jsonl"
    f.write_bytes(lines(b"{", b"{"))
    with pytest.raises(FtcoreError, match="no usable records"):
        build_train_loader(cfg_for(tmp_path, f, "data.on_bad_record=skip"), tok, 0, 1)


def test_json_array_reports_the_line(tmp_path, tok):
    f = tmp_path / "d.json"
    f.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "a"}\n]\n')
    with pytest.raises(FtcoreError, match=f"{f}:3:.*output"):
        build_train_loader(cfg_for(tmp_path, f), tok, 0, 1)
    f.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": \n]\n')
    with pytest.raises(FtcoreError, match=f"{f}:4: malformed JSON"):
        build_train_loader(cfg_for(tmp_path, f), tok, 0, 1)


def test_cli_exits_2_before_training_and_writes_nothing_to_run_dir(
    tmp_path, tok, capsys, monkeypatch
):
    f = tmp_path / "d.jsonl"
    f.write_bytes(lines(GOOD_I, b"{broken"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    run_dir = work / "run"

    def task(cfg):
        build_train_loader(cfg, load_tokenizer(cfg), 0, 1)
        return 0

    args = [f"data.path={f}", f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={run_dir}"]
    assert cli_main("train", task, args) == 2
    err = capsys.readouterr().err
    assert f"{f}:2" in err and "Traceback" not in err
    assert cli_main("train", task, [*args, "data.on_bad_record=skip"]) == 0
    assert list(work.iterdir()) == []  # nothing in the run dir (or anywhere under the cwd)


def test_parquet_directory_and_datasets_dir(tmp_path, tok, caplog):
    from datasets import Dataset

    rows = [{"instruction": f"What is {i} + 1?", "output": str(i + 1)} for i in range(6)]
    d = tmp_path / "mixed"
    (d / "sub").mkdir(parents=True)
    Dataset.from_list(rows[:3]).to_parquet(str(d / "a.parquet"))
    (d / "sub" / "b.jsonl").write_bytes(lines(*rows[3:5]))
    (d / "c.json").write_text(json.dumps(rows[5:]))
    ld = build_train_loader(cfg_for(tmp_path, d), tok, 0, 1)
    assert ld.report["samples"] == 6 and ld.report["bad_records"] == 0
    saved = tmp_path / "saved"
    Dataset.from_list(rows).save_to_disk(str(saved))
    assert build_train_loader(cfg_for(tmp_path, saved), tok, 0, 1).report["samples"] == 6
    # a DatasetDict: its train split is read, and the log says so and how to take another
    from datasets import DatasetDict

    splits = tmp_path / "splits"
    DatasetDict(train=Dataset.from_list(rows[:4]), test=Dataset.from_list(rows[4:])).save_to_disk(
        str(splits)
    )
    with caplog.at_level("INFO", logger="ftcore"):
        assert build_train_loader(cfg_for(tmp_path, splits), tok, 0, 1).report["samples"] == 4
    assert (
        f"data {splits} is a DatasetDict of splits train, test: its train split is read"
        in caplog.text
    )
    assert f"data.path={splits / 'test'}" in caplog.text
    assert build_train_loader(cfg_for(tmp_path, splits / "test"), tok, 0, 1).report["samples"] == 2
    bad = tmp_path / "bad_pq"
    bad.mkdir()
    Dataset.from_list([{"instruction": "x", "output": 1}]).to_parquet(str(bad / "x.parquet"))
    with pytest.raises(FtcoreError, match="row 1.*must be a string"):
        build_train_loader(cfg_for(tmp_path, bad), tok, 0, 1)


def test_dataset_in_local_hf_cache(tmp_path, tok, monkeypatch):
    """A data set name resolves offline from the local Hugging Face cache; a missing one is an error.

    The cache entry is laid out as a download leaves it (<org>___<name>/<config>/<version>/<hash>/
    with dataset_info.json and <name>-train.arrow), built here from a local file: no network."""
    import datasets

    cache = tmp_path / "hf_datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    src = tmp_path / "src.jsonl"
    src.write_bytes(
        lines(*[{"instruction": f"What is {i} + 1?", "output": str(i + 1)} for i in range(5)])
    )
    datasets.load_dataset(
        "json", data_files=str(src), split="train", cache_dir=str(cache / "build")
    )
    (built,) = [p.parent for p in (cache / "build").rglob("dataset_info.json")]
    entry = cache / "someorg___tiny" / "default" / "0.0.0" / built.name
    entry.mkdir(parents=True)
    (entry / "dataset_info.json").write_bytes((built / "dataset_info.json").read_bytes())
    (entry / "tiny-train.arrow").write_bytes((built / "json-train.arrow").read_bytes())
    ld = build_train_loader(cfg_for(tmp_path, "someorg/tiny"), tok, 0, 1)
    assert ld.report["samples"] == 5
    with pytest.raises(FtcoreError, match="local Hugging Face cache"):
        build_train_loader(cfg_for(tmp_path, "someorg/no-such-dataset"), tok, 0, 1)


def test_tokenization_cache_reused_and_invalidated(tmp_path, tok, monkeypatch):
    f = tmp_path / "d.jsonl"
    f.write_bytes(lines(GOOD_I, GOOD_I))
    calls = []
    real = tokenized._build
    monkeypatch.setattr(tokenized, "_build", lambda *a: calls.append(1) or real(*a))
    cfg = cfg_for(tmp_path, f)
    build_train_loader(cfg, tok, 0, 1)
    build_train_loader(cfg, tok, 0, 1)
    assert len(calls) == 1 and len(list((tmp_path / "cache").glob("*.tok"))) == 1
    build_train_loader(
        cfg_for(tmp_path, f, "data.seq_len=32"), tok, 0, 1
    )  # packing/seq_len: same cache
    assert len(calls) == 1
    build_train_loader(cfg_for(tmp_path, f, "data.chat_template=chatml"), tok, 0, 1)
    assert len(calls) == 2
    f.write_bytes(lines(GOOD_I, GOOD_I, GOOD_I))
    os.utime(f, ns=(1, 1))
    assert build_train_loader(cfg, tok, 0, 1).report["samples"] == 3 and len(calls) == 3


def test_config_errors(tmp_path, tok):
    f = tmp_path / "d.jsonl"
    f.write_bytes(lines(GOOD_I))
    for bad, fld in (
        ("data.truncate=left", "data.truncate"),
        ("data.on_bad_record=ignore", "data.on_bad_record"),
        ("data.val_fraction=1.5", "data.val_fraction"),
        ("data.format=xml", "data.format"),
        (f"+data.mix=[{{path: '{f}'}}]", "data.mix"),
    ):
        with pytest.raises(FtcoreError, match=fld):
            build_train_loader(cfg_for(tmp_path, f, bad), tok, 0, 1)


def test_default_cache_dir_is_outside_the_run(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tokenized.default_cache_dir() == tmp_path / "ftcore" / "data"


def test_oversized_record_is_a_bad_record_with_its_line(tmp_path, tok, monkeypatch):
    """Issue 46: a record over sources.MAX_RECORD_BYTES (lowered here) is never held whole: in JSONL
    and in a .json array it is a bad record named by its line, skipped and counted with skip."""
    from ftcore.data import sources

    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 200)
    big = {"instruction": "x" * 5000, "output": "y"}
    f = tmp_path / "d.jsonl"
    f.write_bytes(lines(GOOD_I, GOOD_I, big, GOOD_I))
    a = tmp_path / "d.json"
    a.write_text("[\n" + ",\n".join(json.dumps(r) for r in (GOOD_I, GOOD_I, big, GOOD_I)) + "\n]\n")
    for path, line in ((f, 3), (a, 4)):
        with pytest.raises(FtcoreError, match=f"{path}:{line}: record longer than 200 bytes"):
            build_train_loader(cfg_for(tmp_path, path), tok, 0, 1)
        ld = build_train_loader(cfg_for(tmp_path, path, "data.on_bad_record=skip"), tok, 0, 1)
        assert ld.report["bad_records"] == 1 and ld.report["samples"] == 3


def test_json_array_nested_element_is_a_bad_record(tmp_path, tok):
    f = tmp_path / "d.json"
    deep = '{"instruction": "[{", "output": "y", "z": ' + "[" * 5000 + "]" * 5000 + "}"
    f.write_text(f"[\n{json.dumps(GOOD_I)},\n{deep},\n{json.dumps(GOOD_I)}\n]\n")
    with pytest.raises(FtcoreError, match=f"{f}:3: record nested deeper than 64 levels"):
        build_train_loader(cfg_for(tmp_path, f), tok, 0, 1)
    ld = build_train_loader(cfg_for(tmp_path, f, "data.on_bad_record=skip"), tok, 0, 1)
    assert ld.report["bad_records"] == 1 and ld.report["samples"] == 2


def test_json_array_parses_in_linear_time(tmp_path):
    """Issue 46: a .json array of 50k small records reads about as fast as the same records as
    JSONL (a complexity bound, not a benchmark: the quadratic line count took ~30x as long)."""
    import time

    from ftcore.data import sources

    recs = [{"instruction": f"What is {i} + {i}?", "output": str(2 * i)} for i in range(50_000)]
    (tmp_path / "d.json").write_text("[\n" + ",\n".join(map(json.dumps, recs)) + "\n]\n")
    (tmp_path / "d.jsonl").write_text("\n".join(map(json.dumps, recs)) + "\n")
    took = {}
    for name in ("d.jsonl", "d.json"):
        t0 = time.perf_counter()
        got = list(sources.iter_records([tmp_path / name]))
        took[name] = time.perf_counter() - t0
        assert [r for _, r in got] == recs
    assert got[-1][0] == f"{tmp_path / 'd.json'}:50001"
    assert took["d.json"] < 3 * took["d.jsonl"] + 0.5, took


def test_csv_reads_as_the_same_records_as_jsonl(tmp_path, tok):
    """Issue 52, item 3: a CSV file (written here by datasets/pandas, not by ftcore) gives exactly
    the records it was written from, cells with commas, quotes and newlines included, every cell
    a string (no type guessing: "3" stays the answer text), and trains on the same tokens as the
    same records in JSONL; a row with more cells than its header is a bad record at its line."""
    from datasets import Dataset

    from ftcore.data.sources import iter_records

    rows = [
        {"instruction": f'Say "{i}, then {i + 1}"\nplease', "output": str(i + 1)} for i in range(6)
    ]
    f = tmp_path / "ins.csv"
    Dataset.from_list(rows).to_csv(str(f), index=False)
    assert [r for _, r in iter_records([f])] == rows
    (tmp_path / "ins.jsonl").write_bytes(lines(*rows))
    as_csv = build_train_loader(cfg_for(tmp_path, f), tok, 0, 1).report
    as_jsonl = build_train_loader(cfg_for(tmp_path, tmp_path / "ins.jsonl"), tok, 0, 1).report
    assert as_csv["samples"] == 6 and as_csv["tokens"] == as_jsonl["tokens"] > 0
    bad = tmp_path / "bad.csv"
    bad.write_text('instruction,output\nWhat is 1 + 1?,2\n"What is 2, + 2?",4,extra\n')
    with pytest.raises(FtcoreError, match=rf"{bad}:3: 3 cells under a header of 2"):
        build_train_loader(cfg_for(tmp_path, bad), tok, 0, 1)
