"""A data source tokenized once: documents (ids + target flags), cached under data.cache_dir.

The cache key covers the data files (path, size, mtime), the tokenizer, the format, the chat
template and the masking settings; truncation and packing happen later, so they are not part of
it. Rank 0 builds the cache while the other ranks wait at a barrier, then they read it; a rank
that finds no cache (another node's disk, an error on rank 0) builds the same thing itself, so an
error in the data is raised by every rank alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ftcore.data import sources
from ftcore.data.templates import BadRecord, Doc, Renderer
from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")
CACHE_VERSION = 2  # 2: chat ids are the whole rendered text tokenized once


@dataclass
class Tokenized:
    """Documents of one source, stored flat: doc i is ids[offsets[i]:offsets[i+1]]."""

    ids: np.ndarray  # int32
    targets: np.ndarray  # bool
    offsets: np.ndarray  # int64, len = docs + 1
    bad_records: int = 0
    bad_examples: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> Doc:
        a, b = self.offsets[i], self.offsets[i + 1]
        return Doc(self.ids[a:b], self.targets[a:b])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ftcore" / "data"


def tokenizer_fingerprint(tok) -> str:
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    h.update(
        backend.to_str().encode()
        if backend is not None
        else repr(sorted(tok.get_vocab().items())).encode()
    )
    h.update(repr((tok.bos_token, tok.eos_token, type(tok).__name__)).encode())
    return h.hexdigest()


def _build(files, renderer: Renderer, on_bad: str, max_samples: int | None) -> Tokenized:
    ids, targets, offsets, bad, examples = [], [], [0], 0, []
    for where, rec in sources.iter_records(files):
        if max_samples is not None and len(offsets) - 1 >= max_samples:
            break
        try:
            if isinstance(rec, Exception):
                raise rec
            doc = renderer.doc(rec)
        except (BadRecord, sources.RecordError) as e:
            if on_bad != "skip":
                raise FtcoreError(
                    f"{where}: {e}",
                    field="data.path",
                    fix="fix or remove the record, or skip bad records with data.on_bad_record=skip",
                ) from None
            bad += 1
            if len(examples) < 5:
                examples.append(f"{where}: {e}")
            continue
        ids.append(doc.ids)
        targets.append(doc.targets)
        offsets.append(offsets[-1] + len(doc))
    if len(offsets) == 1:
        raise FtcoreError(
            f"no usable records in {files if isinstance(files, str) else ', '.join(map(str, files))}"
            + (f" ({bad} bad records skipped)" if bad else ""),
            field="data.path",
            fix="check the data format (data.format) and the records",
        )
    return Tokenized(
        ids=np.concatenate(ids).astype(np.int32),
        targets=np.concatenate(targets),
        offsets=np.asarray(offsets, np.int64),
        bad_records=bad,
        bad_examples=examples,
    )


def _save(path: Path, t: Tokenized) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp.npz")
    os.close(fd)
    meta = json.dumps({"bad_records": t.bad_records, "bad_examples": t.bad_examples})
    np.savez(tmp, ids=t.ids, targets=t.targets, offsets=t.offsets, meta=np.array(meta))
    os.replace(tmp, path)  # atomic: readers see a complete file or none


def _load(path: Path) -> Tokenized | None:
    try:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            return Tokenized(
                z["ids"], z["targets"], z["offsets"], meta["bad_records"], meta["bad_examples"]
            )
    except (OSError, ValueError, KeyError):
        return None


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def tokenize_source(
    path: str, tokenizer, data_cfg, fmt: str | None = None, field: str = "data.path"
) -> Tokenized:
    """The documents of one data path, from the cache when it is there."""
    fmt = fmt or data_cfg.format
    files = sources.resolve(path, field)
    renderer = Renderer(tokenizer, fmt, data_cfg.chat_template, data_cfg.train_on_prompt)
    key = json.dumps(
        [
            CACHE_VERSION,
            sources.describe(files),
            tokenizer_fingerprint(tokenizer),
            fmt,
            renderer.template,
            bool(data_cfg.train_on_prompt),
            data_cfg.on_bad_record,
            data_cfg.max_samples,
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    cache_dir = Path(data_cfg.cache_dir).expanduser() if data_cfg.cache_dir else default_cache_dir()
    cache = cache_dir / f"{digest}.npz"
    build = lambda: _build(files, renderer, data_cfg.on_bad_record, data_cfg.max_samples)  # noqa: E731
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    result, error = None, None
    if rank == 0:
        result = _load(cache)
        if result is None:
            try:
                result = build()
                try:
                    _save(cache, result)
                except OSError as e:
                    log.warning("data: cannot write the tokenization cache %s (%s)", cache, e)
            except FtcoreError as e:
                error = e
    if dist:
        dist.barrier()  # rank 0 built (or failed); the others read what it wrote
    if error is not None:
        raise error
    if result is None:
        result = _load(cache) or build()
    return result
