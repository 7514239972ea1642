"""The tokenization cache is a set of memory-mapped arrays built as the records stream in: the
loader reads its documents from the memory map; an entry written for another tokenizer, with a
header that does not match, or cut short is rebuilt; a leftover temporary is never read; a bad
record leaves nothing behind; and the builder's resident memory does not grow with the data."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ftcore.config.schema import compose
from ftcore.data import token_cache, tokenized
from ftcore.data.pipeline import build_train_loader
from ftcore.data.tokenizer import load_tokenizer
from ftcore.errors import FtcoreError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(compose([]))


def write_data(path: Path, n: int = 30) -> Path:
    path.write_text("".join(json.dumps({"instruction": f"What is {i} + 2?", "output": str(i + 2)})
                            + "\n" for i in range(n)))  # fmt: skip
    return path


def cfg_for(tmp_path, data, *extra):
    return compose([f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=64",
                    "train.global_batch_size=4", "train.micro_batch_size=2", *extra])  # fmt: skip


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = tokenized._build
    monkeypatch.setattr(tokenized, "_build", lambda *a: calls.append(1) or real(*a))
    return calls


def entries(tmp_path) -> list[Path]:
    return sorted((tmp_path / "cache").glob(f"*{token_cache.SUFFIX}"))


def batches(ld, steps: int = 2) -> list[np.ndarray]:
    return [mb.tokens.numpy() for _ in range(steps) for mb in ld.next_microbatches()]


def test_the_loader_reads_the_memory_map(tmp_path, tok, counted):
    data = write_data(tmp_path / "d.jsonl")
    ld = build_train_loader(cfg_for(tmp_path, data), tok, 0, 1)
    (entry,) = entries(tmp_path)
    table = ld.docs.docs
    assert [Path(s.ids.filename) for s in table.sources] == [entry / "ids.bin"]
    assert isinstance(table.sources[0].targets, np.memmap)
    doc = table[3]  # a view into the map, not a copy
    assert isinstance(doc.ids, np.memmap) and not doc.ids.flags.writeable
    assert len(table) == ld.report["samples"] == 30 and counted == [1]


def test_entry_for_another_tokenizer_or_broken_is_rebuilt(tmp_path, tok, counted):
    data = write_data(tmp_path / "d.jsonl")
    cfg = cfg_for(tmp_path, data)
    ref = batches(build_train_loader(cfg, tok, 0, 1))
    (entry,) = entries(tmp_path)
    other = load_tokenizer(compose([]))
    other.add_tokens(["<zz_new>"])  # another tokenizer: another key, another entry
    build_train_loader(cfg, other, 0, 1)
    assert counted == [1, 1] and len(entries(tmp_path)) == 2
    header = json.loads((entry / "header.json").read_text())
    (entry / "header.json").write_text(json.dumps(header | {"key": "written by another version"}))
    got = batches(build_train_loader(cfg, tok, 0, 1))
    assert len(counted) == 3 and all(np.array_equal(a, b) for a, b in zip(got, ref))
    with open(entry / "ids.bin", "r+b") as f:  # cut short (a crash while copying, a full disk)
        f.truncate(8)
    got = batches(build_train_loader(cfg, tok, 0, 1))
    assert len(counted) == 4 and all(np.array_equal(a, b) for a, b in zip(got, ref))


def test_leftover_temporaries_are_never_read(tmp_path, tok, counted):
    data = write_data(tmp_path / "d.jsonl")
    cfg = cfg_for(tmp_path, data)
    ref = batches(build_train_loader(cfg, tok, 0, 1))
    (entry,) = entries(tmp_path)
    # a complete-looking temporary with other tokens, from a writer on another host
    foreign = entry.with_name(f"{entry.stem}.tmp-otherhost-1-abc")
    os.rename(entry, foreign)
    ids = np.memmap(foreign / "ids.bin", np.int32, "r+")
    ids[:] = 7
    ids.flush()
    del ids
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a temporary of a writer of this host that is gone: removed
    stale = entry.with_name(f"{entry.stem}.tmp-{socket.gethostname()}-{dead.pid}-xyz")
    stale.mkdir()
    got = batches(build_train_loader(cfg, tok, 0, 1))
    assert counted == [1, 1] and all(np.array_equal(a, b) for a, b in zip(got, ref))
    assert foreign.is_dir() and not stale.exists()


def test_bad_record_names_the_line_and_leaves_no_cache(tmp_path, tok):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "a", "output": 3}\n')
    with pytest.raises(FtcoreError, match=f"{data}:3: "):
        build_train_loader(cfg_for(tmp_path, data), tok, 0, 1)
    assert list((tmp_path / "cache").iterdir()) == []


PROBE = """
import json, random, sys
from pathlib import Path
from ftcore.config.schema import compose
from ftcore.data import token_cache
from ftcore.data.tokenized import tokenize_source
from ftcore.data.tokenizer import load_tokenizer
from ftcore.runtime.host_memory import reset_peak, status

token_cache.FLUSH_TOKENS = 4096
tmp = Path(sys.argv[1])
words = "the of and to in is that for it as was with be by on not model data token".split()
r = random.Random(0)
answers = [" ".join(r.choices(words, k=600)) for _ in range(64)]
def write(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"instruction": f"Question {i}", "output": answers[i % 64]}) + "\\n")
cfg = compose([f"data.cache_dir={tmp / 'cache'}"])
tok = load_tokenizer(cfg)
write(tmp / "small.jsonl", 50)
tokenize_source(str(tmp / "small.jsonl"), tok, cfg.data)  # first use: allocations that stay
write(tmp / "big.jsonl", 1500)
reset_peak()
before = status("VmRSS")
t = tokenize_source(str(tmp / "big.jsonl"), tok, cfg.data)
print(json.dumps({"growth": status("VmHWM") - before, "tokens": int(t.offsets[-1]),
                  "bytes": (tmp / "big.jsonl").stat().st_size}))
"""


def test_resident_memory_does_not_grow_with_the_data(tmp_path):
    """Tokenizing a file of some MB raises the builder's peak RSS by far less than its token ids
    would take as int64 (the whole-file build held them all, as arrays and Python lists)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), FTCORE_LOG_LEVEL="WARNING")
    r = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True,
                       text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bytes"] > 3e6 and out["tokens"] > 1e6, out
    assert out["growth"] < out["tokens"] * 8 / 8, out


def mixed_records(path: Path, n: int = 700) -> Path:
    """Instruction records over several pool chunks, with bad ones: an answer that is not a
    string (BadRecord) and a line that is not JSON (RecordError)."""
    lines = []
    for i in range(n):
        out = 3 if i % 97 == 5 else " ".join(["answer"] * (i % 13)) + f" {i}"
        lines.append(json.dumps({"instruction": f"Question {i}?", "output": out}))
    lines[250] = '{"instruction": "cut'
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_worker_pool_builds_the_same_entry_byte_for_byte(tmp_path, tok):
    data = mixed_records(tmp_path / "d.jsonl")
    built = {}
    for workers in (1, 2):
        cache = tmp_path / f"cache{workers}"
        cfg = compose([f"data.path={data}", f"data.cache_dir={cache}", "data.on_bad_record=skip",
                       "data.max_samples=650", f"data.tokenize_workers={workers}"])  # fmt: skip
        t = tokenized.tokenize_source(str(data), tok, cfg.data)
        (entry,) = cache.glob(f"*{token_cache.SUFFIX}")
        built[workers] = {f.name: f.read_bytes() for f in sorted(entry.iterdir())}
        assert len(t) == 650 and t.bad_records == 8  # 7 BadRecords and one line before doc 650
    assert built[1] == built[2]
    bad = compose([f"data.path={data}", f"data.cache_dir={tmp_path / 'c3'}",
                   "data.tokenize_workers=2"])  # fmt: skip
    with pytest.raises(FtcoreError, match=f"{data}:6: "):  # the first bad record, as in-process
        tokenized.tokenize_source(str(data), tok, bad.data)
    assert not any((tmp_path / "c3").glob(f"*{token_cache.SUFFIX}"))


def test_worker_count():
    from ftcore.data.render_pool import AUTO_MIN_BYTES, choose_workers, usable_cpus

    assert choose_workers(3, None) == 3 and choose_workers(1, 10 << 30) == 1
    assert choose_workers(0, AUTO_MIN_BYTES - 1) == 1 and choose_workers(0, None) == 1
    assert choose_workers(0, AUTO_MIN_BYTES) == min(usable_cpus(), 32)


def test_an_altered_or_foreign_entry_is_never_read(tmp_path, tok, counted, monkeypatch):
    """Issue 46: the header carries a checksum of itself and of the document offsets, so an entry
    whose offsets (or header counts) were changed in place, sizes kept, is rebuilt; an entry another
    user owns (a shared data.cache_dir) is refused with exit 2 naming the field."""
    data = write_data(tmp_path / "d.jsonl")
    cfg = cfg_for(tmp_path, data)
    ref = batches(build_train_loader(cfg, tok, 0, 1))
    (entry,) = entries(tmp_path)
    offsets = np.fromfile(entry / "offsets.bin", np.int64)
    offsets[1:-1] = offsets[1]  # every document but one made empty: same size, other content
    offsets.tofile(entry / "offsets.bin")
    got = batches(build_train_loader(cfg, tok, 0, 1))
    assert len(counted) == 2 and all(np.array_equal(a, b) for a, b in zip(got, ref))
    header = json.loads((entry / "header.json").read_text())
    (entry / "header.json").write_text(json.dumps(header | {"bad_records": 7}))
    build_train_loader(cfg, tok, 0, 1)
    assert len(counted) == 3
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)  # as another user sees this entry
    with pytest.raises(FtcoreError, match=r"data\.cache_dir: cache entry .* belongs to user id"):
        build_train_loader(cfg, tok, 0, 1)
