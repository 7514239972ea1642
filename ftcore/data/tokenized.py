"""A data source tokenized once: documents (ids + target flags), cached under data.cache_dir.

The cache key covers the data files (path, size, mtime), the tokenizer, the format, the chat
template and the masking settings; truncation and packing happen later, so they are not part of
it. Records are tokenized as they are read and appended to a memory-mapped cache entry
(ftcore.data.token_cache), so neither the text nor the ids of a whole data set are ever held in
memory, and the ranks of a node share one copy of the tokens through the page cache. Rank 0
builds the entry while the other ranks wait at a barrier; then the local rank 0 of every other
node builds it where its disk does not have it (a node-local cache directory), and every rank
opens it. A rank that still finds no entry builds the same thing itself, so an error in the data
is raised by every rank alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ftcore.data import render_pool, sources, token_cache
from ftcore.data.templates import BadRecord, Doc, Renderer
from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")
CACHE_VERSION = 3  # 2: chat ids are the whole rendered text tokenized once; 3: memory-mapped


@dataclass
class Tokenized:
    """Documents of one source, stored flat: doc i is ids[offsets[i]:offsets[i+1]]. From the
    cache the arrays are read-only memory maps: a document is read when it is used."""

    ids: np.ndarray  # int32
    targets: np.ndarray  # bool
    offsets: np.ndarray  # int64, len = docs + 1
    bad_records: int = 0
    bad_examples: list[str] = field(default_factory=list)
    learn: np.ndarray | None = None  # int32 per doc: targets after its first token
    group: int = 1  # documents per sample: 2 for preference pairs (chosen, rejected)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def samples(self) -> int:
        """Records kept (pairs for preference data); sample i is documents group*i ... + group-1."""
        return len(self) // self.group

    def doc(self, i: int) -> Doc:
        a, b = self.offsets[i], self.offsets[i + 1]
        return Doc(self.ids[a:b], self.targets[a:b])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc_learn(self, picks: np.ndarray) -> np.ndarray:
        """Targets after the first token of each picked document (stored in the cache)."""
        if self.learn is not None:
            return np.asarray(self.learn[picks], np.int64)
        off = self.offsets
        return np.asarray([np.count_nonzero(self.targets[off[i] + 1 : off[i + 1]]) for i in picks],
                          np.int64)  # fmt: skip


class DocTable:
    """The documents a loader draws from, as a read-only sequence of Docs over the sources'
    (memory-mapped) tokens: document i is tokens start[i]:start[i]+length[i] of source src[i]
    (a right-truncated document has a shorter length). Per document only these numbers and its
    target count are held in memory; its tokens are read when it is indexed."""

    def __init__(self):
        self.sources: list[Tokenized] = []
        self.src = np.zeros(0, np.int32)
        self.start = np.zeros(0, np.int64)
        self.lengths = np.zeros(0, np.int64)
        self.learn = np.zeros(0, np.int64)  # targets after the first token, per document

    def extend(self, tok: Tokenized, start, lengths, learn) -> None:
        self.sources.append(tok)
        k = len(self.sources) - 1
        self.src = np.concatenate([self.src, np.full(len(start), k, np.int32)])
        self.start = np.concatenate([self.start, np.asarray(start, np.int64)])
        self.lengths = np.concatenate([self.lengths, np.asarray(lengths, np.int64)])
        self.learn = np.concatenate([self.learn, np.asarray(learn, np.int64)])

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, i):
        if isinstance(i, slice):
            out = DocTable()
            out.sources = self.sources
            out.src, out.start = self.src[i], self.start[i]
            out.lengths, out.learn = self.lengths[i], self.learn[i]
            return out
        tok, a = self.sources[self.src[i]], int(self.start[i])
        b = a + int(self.lengths[i])
        return Doc(tok.ids[a:b], tok.targets[a:b])

    def __iter__(self):
        return (self[i] for i in range(len(self)))


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


def _build(
    files, renderer: Renderer, on_bad: str, max_samples: int | None, entry: Path, key: str,
    workers: int = 1,
) -> Tokenized:  # fmt: skip
    """Tokenize the records into a new cache entry, in record order (render_pool.py: by `workers`
    processes); the entry, memory-mapped."""
    try:
        writer = token_cache.Writer(entry, key)
    except OSError as e:
        raise _unwritable(entry, e) from None
    bad, examples = 0, []
    group = 2 if renderer.fmt == "preference" else 1  # a pair: two documents, kept together
    docs = render_pool.rendered(sources.iter_records(files), renderer, workers)
    try:
        for where, doc in docs:
            if max_samples is not None and writer.docs >= max_samples * group:
                break
            if isinstance(doc, (BadRecord, sources.RecordError)):
                e = doc
                if on_bad != "skip":
                    raise _bad_record(where, e, writer.docs > 0 or _any_good(docs)) from None
                bad += 1
                if len(examples) < 5:
                    examples.append(f"{where}: {e}")
                continue
            for d in doc.docs if group > 1 else (doc,):
                writer.add(d.ids, d.targets)
        if writer.docs == 0:
            raise FtcoreError(
                f"no usable records in {files if isinstance(files, str) else ', '.join(map(str, files))}"
                + (f" ({bad} bad records skipped)" if bad else ""),
                field="data.path",
                fix="check the data format (data.format) and the records",
            )
        writer.commit({"bad_records": bad, "bad_examples": examples})
    except OSError as e:
        writer.abort()
        raise _unwritable(entry, e) from None
    except BaseException:
        writer.abort()
        raise
    finally:
        docs.close()  # stops the worker pool when max_samples or an error ends the loop early
    out = _load(entry, key)
    if out is None:
        raise _unwritable(entry, OSError("the entry written cannot be read back"))
    return out


LOOK_AHEAD = 1000  # records read past the first bad one to find whether skipping would keep any


def _any_good(docs) -> bool:
    """Whether one of the next LOOK_AHEAD records is usable (only on the way to an error)."""
    for _, (_, doc) in zip(range(LOOK_AHEAD), docs):
        if not isinstance(doc, (BadRecord, sources.RecordError)):
            return True
    return False


def _bad_record(where: str, e: Exception, others_usable: bool) -> FtcoreError:
    """The first bad record; skipping is offered only where it would keep some records."""
    if others_usable:
        fix = "fix or remove the record, or skip bad records with data.on_bad_record=skip"
    else:
        fix = ("the records around it have the same problem: check data.format (default auto: "
               "from the first record) and the records' shape (docs/data.md)")  # fmt: skip
    return FtcoreError(f"{where}: {e}", field="data.path", fix=fix)


def _unwritable(entry: Path, e: OSError) -> FtcoreError:
    return FtcoreError(
        f"cannot write the tokenization cache {entry} ({e})",
        field="data.cache_dir",
        fix="point data.cache_dir at a writable directory with room for the tokens "
        "(about 5 bytes per token)",
    )


def _load(entry: Path, key: str) -> Tokenized | None:
    opened = token_cache.open_entry(entry, key)
    if opened is None:
        return None
    a, header = opened
    return Tokenized(
        a["ids"], a["targets"], a["offsets"], header["bad_records"], header["bad_examples"],
        a["learn"],
    )  # fmt: skip


_SAID: set[str] = set()


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier() -> None:
    from ftcore.runtime import collectives  # only with a process group: torch is there already

    collectives.barrier()


def tokenize_source(
    path: str, tokenizer, data_cfg, fmt: str | None = None, field: str = "data.path"
) -> Tokenized:
    """The documents of one data path, from the cache when it is there."""
    fmt = fmt or data_cfg.format
    files = sources.resolve(path, field)
    note = sources.split_note(str(path))
    if note and note not in _SAID and (_dist() is None or _dist().get_rank() == 0):
        _SAID.add(note)  # once per process: held-out evaluation reads the same path again
        log.info("%s", note)
    if fmt == "auto":  # a caller that did not resolve the config first (formats.resolve)
        from ftcore.data import formats

        fmt = formats.detect_source(path, field)
    renderer = Renderer(tokenizer, fmt, data_cfg.chat_template, data_cfg.train_on_prompt)
    described = sources.describe(files)
    key = json.dumps(
        [
            CACHE_VERSION,
            described,
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
    entry = cache_dir / f"{digest}{token_cache.SUFFIX}"
    # the worker count changes how fast the entry is built, never what it holds: not in the key
    workers = render_pool.choose_workers(
        int(getattr(data_cfg, "tokenize_workers", 0) or 0), sum(d[1] for d in described)
    )
    args = (files, renderer, data_cfg.on_bad_record, data_cfg.max_samples, entry, key, workers)
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if dist else 0
    result, error = None, None
    # rank 0 first, then the local rank 0 of the nodes whose disk lacks the entry
    for builder in (rank == 0, local_rank == 0 and rank != 0):
        if builder and error is None:
            result = _load(entry, key)
            if result is None:
                try:
                    result = _build(*args)
                except FtcoreError as e:
                    error = e
        if dist:
            _barrier()  # the builders built (or failed); the others read what they wrote
    if error is not None:
        raise error
    if result is None:
        result = _load(entry, key) or _build(*args)
    result.group = 2 if fmt == "preference" else 1
    return result
