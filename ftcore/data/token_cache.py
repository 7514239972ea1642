"""The tokenization cache on disk: flat arrays that every rank of a node memory-maps.

An entry is a directory `<digest>.tok/` holding `header.json` and raw arrays (native byte order):
`ids.bin` (int32 per token), `targets.bin` (bool per token), `offsets.bin` (int64, documents + 1;
document i is tokens offsets[i]:offsets[i+1]) and `learn.bin` (int32 per document: its targets
after the first token, what the data report counts without reading the tokens). The arrays are
written as the records stream in, under a temporary name (`<digest>.tmp-<host>-<pid>-<random>`),
and the directory is renamed whole once complete: a reader sees a complete entry or none. The
header repeats the cache key and the array sizes, so an entry written for other data, another
tokenizer or other settings, or cut short, is refused and rebuilt; it also holds a SHA-256 of
itself and of `offsets.bin` (an altered header or document index is rebuilt too), and an entry
that another user owns is refused (data.cache_dir may be shared, but never trusted). Reading through np.memmap
shares the pages through the page cache: the ranks of a node hold one copy, and only the pages
they touch are resident.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np

from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files
from ftcore.runtime.run_lock import pid_alive

ARRAYS = {"ids": np.int32, "targets": np.bool_, "offsets": np.int64, "learn": np.int32}
SUFFIX = ".tok"
FLUSH_TOKENS = 1 << 20  # tokens buffered before a write: bounds the builder's memory


class Writer:
    """Appends documents to a new cache entry; `commit` publishes it under its final name."""

    def __init__(self, final: Path, key: str):
        self.final, self.key = final, key
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_temporaries(final)
        prefix = f"{final.stem}.tmp-{socket.gethostname()}-{os.getpid()}-"
        self.tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=prefix))
        self.files = {k: safe_files.create(self.tmp / f"{k}.bin") for k in ARRAYS}
        self.buf: dict[str, list[np.ndarray]] = {k: [] for k in ARRAYS}
        self.buffered, self.tokens, self.docs = 0, 0, 0
        self.files["offsets"].write(np.zeros(1, np.int64).tobytes())

    def add(self, ids: np.ndarray, targets: np.ndarray) -> None:
        n = len(ids)
        self.tokens += n
        self.docs += 1
        self.buf["ids"].append(np.asarray(ids, np.int32))
        self.buf["targets"].append(np.asarray(targets, np.bool_))
        self.buf["offsets"].append(np.asarray([self.tokens], np.int64))
        self.buf["learn"].append(np.asarray([int(np.count_nonzero(targets[1:]))], np.int32))
        self.buffered += n
        if self.buffered >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        for k, parts in self.buf.items():
            if parts:
                self.files[k].write(np.concatenate(parts).astype(ARRAYS[k], copy=False).tobytes())
                parts.clear()
        self.buffered = 0

    def commit(self, meta: dict) -> None:
        """Close the arrays, write the header, rename the entry into place (an entry another
        process published first is kept: it holds the same documents)."""
        self.flush()
        for f in self.files.values():
            f.close()
        header = {"key": self.key, "tokens": self.tokens, "docs": self.docs, **meta}
        header["checksum"] = _checksum(header, self.tmp)
        safe_files.write_exclusive(self.tmp / "header.json", json.dumps(header).encode())
        if self.final.exists() and read_header(self.final, self.key) is None:
            _discard(self.final)  # stale or broken: replaced by this one
        try:
            os.rename(self.tmp, self.final)
        except OSError:
            if read_header(self.final, self.key) is None:
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)  # another rank or node was first

    def abort(self) -> None:
        for f in self.files.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _checksum(header: dict, entry: Path) -> str:
    """SHA-256 of the header (without its checksum) and of offsets.bin."""
    h = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "checksum"},
                                  sort_keys=True).encode())  # fmt: skip
    with safe_files.open_read(entry / "offsets.bin", "data.cache_dir", root=entry) as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def _check_owner(entry: Path) -> None:
    """The entry and its files belong to this user and are not links: a shared data.cache_dir
    may hold entries others wrote, which are never read."""
    for p in [entry, *(entry / f"{k}.bin" for k in ARRAYS), entry / "header.json"]:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue  # incomplete: read_header says so
        if st.st_uid != os.getuid() or os.path.islink(p):
            raise FtcoreError(
                f"cache entry {p} belongs to user id {st.st_uid}, not to you (uid {os.getuid()})"
                if st.st_uid != os.getuid()
                else f"cache entry {p} is a symbolic link",
                field="data.cache_dir",
                fix="data.cache_dir=<a directory of your own> (ftcore never reads a token cache "
                "another user wrote)",
            )


def read_header(entry: Path, key: str) -> dict | None:
    """The header of a complete entry written for `key` by this user, else None (FtcoreError for
    an entry another user owns)."""
    if entry.exists() or entry.is_symlink():
        _check_owner(entry)
    try:
        header = safe_files.read_json_object(entry / "header.json", "data.cache_dir", root=entry)
        sizes = {"ids": header["tokens"], "targets": header["tokens"]}
        sizes |= {"offsets": header["docs"] + 1, "learn": header["docs"]}
        if header["key"] != key:
            return None
        for k, n in sizes.items():
            if (entry / f"{k}.bin").stat().st_size != n * np.dtype(ARRAYS[k]).itemsize:
                return None
        if header.get("checksum") != _checksum(header, entry):
            return None  # altered (or written before checksums): rebuilt
        return header
    except (OSError, ValueError, KeyError, TypeError, FtcoreError):  # rebuilt
        return None


def open_entry(entry: Path, key: str) -> tuple[dict[str, np.ndarray], dict] | None:
    """(read-only memory-mapped arrays, header) of a valid entry, else None."""
    header = read_header(entry, key)
    if header is None:
        return None
    sizes = {"ids": header["tokens"], "targets": header["tokens"]}
    sizes |= {"offsets": header["docs"] + 1, "learn": header["docs"]}
    arrays = {
        k: np.memmap(entry / f"{k}.bin", dtype=ARRAYS[k], mode="r", shape=(n,))
        if n
        else np.zeros(0, ARRAYS[k])
        for k, n in sizes.items()
    }
    return arrays, header


def _discard(entry: Path) -> None:
    aside = entry.with_name(f"{entry.name}.stale-{os.getpid()}")
    try:
        os.rename(entry, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _remove_dead_temporaries(final: Path) -> None:
    """Temporaries of this entry left by a process of this host that is gone (killed while
    writing): they are never read, only their disk space is taken back."""
    host = socket.gethostname()
    for tmp in final.parent.glob(f"{final.stem}.tmp-{host}-*"):
        pid = tmp.name[len(f"{final.stem}.tmp-{host}-") :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
