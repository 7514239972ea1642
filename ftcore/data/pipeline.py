"""What the trainer calls: sources -> documents -> truncation -> rows -> DP-sharded micro-batches.

The global order of rows does not depend on the DP size (ftcore.data.sampler), so every layout
computes the same global batches; each DP rank takes its contiguous slice of each one.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from ftcore.config.schema import assets_dir
from ftcore.data import formats
from ftcore.data.packing import MicroBatch, attention_mask_from_segments, make_microbatch
from ftcore.data.sampler import Sampler, rng
from ftcore.data.samples import (
    Docs,
    doc_learn,
    doc_lengths,
    doc_rows,
    name_drops,
    per_sample,
    truncate,
)
from ftcore.data.templates import Doc
from ftcore.data.tokenized import tokenize_source
from ftcore.data.transfer import pin_host_batches
from ftcore.errors import FtcoreError
from ftcore.planner.cp import sequence_multiple

__all__ = [
    "Docs",
    "MicroBatch",
    "TrainLoader",
    "attention_mask_from_segments",
    "build_train_loader",
    "build_val_batches",
    "trim_multiple",
]
log = logging.getLogger("ftcore")


def bundled_data(split: str, fmt: str | None = None) -> str:
    """The bundled sample of a split: instruction records, or preference pairs or prompts for
    those formats."""
    name = {"preference": f"preference_{split}", "prompt": f"prompts_{split}"}.get(fmt, split)
    return str(assets_dir() / "data" / f"{name}.jsonl")


def _check(cfg) -> None:
    d = cfg.data
    if d.truncate not in ("right", "drop"):
        raise FtcoreError(
            f"unknown truncation {d.truncate}", field="data.truncate", fix="use right or drop"
        )
    if d.on_bad_record not in ("error", "skip"):
        raise FtcoreError(
            f"unknown policy {d.on_bad_record}", field="data.on_bad_record", fix="use error or skip"
        )
    if not 0.0 <= d.val_fraction < 1.0:
        raise FtcoreError(
            f"{d.val_fraction} is not in [0, 1)", field="data.val_fraction", fix="use e.g. 0.05"
        )
    if d.seq_len < 2:
        raise FtcoreError("seq_len must be at least 2", field="data.seq_len", fix="use e.g. 256")
    if d.mix and d.path:
        raise FtcoreError(
            "data.path and data.mix are both set",
            field="data.mix",
            fix="list every source in data.mix",
        )
    formats.check_preference(cfg)


def train_sources(cfg) -> list[tuple[str, float, str | None, str]]:
    """(path, weight, format, config field) of every training source."""
    if cfg.data.mix:
        return [
            (m.path, float(m.weight), m.get("format"), f"data.mix[{i}].path")
            for i, m in enumerate(cfg.data.mix)
        ]
    return [(cfg.data.path or bundled_data("train", cfg.data.format), 1.0, None, "data.path")]


def held_out_split(n: int, cfg) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out ids) of a source of n documents, from data.val_fraction and the seed."""
    perm = rng(cfg.run.seed, 4).permutation(n)
    k = int(round(n * cfg.data.val_fraction))
    return np.sort(perm[k:]), np.sort(perm[:k])


def fits(cfg, group: int):
    """For packed pairs: which samples' documents fit one row together (data/samples.py)."""
    if group == 1 or not cfg.data.packing:
        return None
    return lambda lengths: packing_lengths(cfg, lengths).sum(1) <= cfg.data.seq_len


def _load_train(cfg, tokenizer) -> tuple[Docs, list[int]]:
    docs, sizes, weights = Docs(), [], []
    for path, weight, fmt, fld in train_sources(cfg):
        if weight <= 0:
            raise FtcoreError(
                f"weight {weight} is not positive",
                field=fld.replace(".path", ".weight"),
                fix="use a weight > 0",
            )
        tok = tokenize_source(path, tokenizer, cfg.data, fmt, fld)
        docs.bad_records += tok.bad_records
        train_ids, _ = held_out_split(tok.samples, cfg)
        d = cfg.data
        named = len(docs.drop_examples)
        ids = truncate(docs, tok, train_ids, d.seq_len, d.truncate, fits(cfg, tok.group))
        if _rank0():
            name_drops(path, tok, docs.drop_examples[named:])
        if len(ids) == 0:
            raise FtcoreError(
                f"every sample of {path} is longer than data.seq_len"
                + (
                    " (a packed pair: both sequences in one row)"
                    if d.packing and tok.group > 1
                    else ""
                ),  # fmt: skip
                field="data.seq_len",
                fix="raise data.seq_len or use data.truncate=right",
            )
        docs.source_ids.append(ids)
        sizes.append(len(ids))
        weights.append(weight)
    total, wsum = sum(sizes), sum(weights)
    counts = [max(1, int(round(total * w / wsum))) for w in weights] if len(sizes) > 1 else sizes
    return docs, counts


def trim_multiple(cfg) -> int | None:
    """What unpacked micro-batches are cut to a multiple of (None: always data.seq_len).

    Unpacked rows are mostly padding, which costs full compute although the loss and every real
    token's attention ignore it; cutting a micro-batch to its longest row (what HF's
    DataCollatorForSeq2Seq does) leaves the math unchanged. The width stays divisible by what the
    layout splits the sequence over: TP ranks under sequence parallelism, 2 x CP chunks, and
    128 for FP8/FP4 GEMMs (Transformer Engine wants aligned token dimensions). On GPUs it is
    rounded to 8 for tensor-core tiles; on CPU any width runs as fast, so it is not rounded."""
    d, p, prec = cfg.data, cfg.parallel, cfg.precision
    if d.packing or not d.trim_padding:
        return None
    m = 1 if cfg.cluster.device == "cpu" else 8
    m = math.lcm(m, sequence_multiple(p))
    if prec.fp8_recipe or prec.fp4_recipe:
        m = math.lcm(m, 128)
    return m


def doc_multiple(cfg) -> int:
    """What each packed document is padded to: 2*cp under context parallelism (TE's THD layout
    splits every document into 2*cp chunks, data/cp.py), else 1 (no padding)."""
    cp = cfg.parallel.get("cp", 1)
    return 2 * cp if cfg.data.packing and cp > 1 else 1


def packing_lengths(cfg, lengths: np.ndarray) -> np.ndarray:
    """Document lengths as packing counts them: rounded up to data.pack_multiple (capped at
    seq_len, which divides by 2*cp), whatever the layout. A row of them has room for every
    document's CP padding at any cp with 2*cp dividing the multiple, so cp changes no row."""
    m = int(cfg.data.get("pack_multiple", 1))
    return np.minimum(-(-lengths // m) * m, cfg.data.seq_len)


def row_width(rows: list[list[Doc]], seq_len: int, multiple: int | None) -> int:
    """seq_len, or (trimming) the longest row rounded up to the layout's multiple."""
    if multiple is None:
        return seq_len
    longest = max([sum(len(d) for d in r) for r in rows] + [2])
    return min(seq_len, -(-longest // multiple) * multiple)


def assemble(cfg, docs: Docs, rows: list[list[int]], pad_id: int) -> list[MicroBatch]:
    """This rank's rows of one global batch (document ids) -> its micro-batches, each as wide as
    row_width says; under PP all of a step's micro-batches take the widest (pipeline sends have
    one shape per step). Training and evaluation both come through here."""
    micro, multiple = cfg.train.micro_batch_size, trim_multiple(cfg)
    laid = [doc_rows(rows[i : i + micro], docs.group, cfg.data.packing)
            for i in range(0, len(rows), micro)]  # fmt: skip
    groups = [[[docs.docs[d] for d in r] for r in g] for g, _ in laid]
    widths = [row_width(g, cfg.data.seq_len, multiple) for g in groups]
    if cfg.parallel.pp > 1:
        widths = [max(widths)] * len(widths)
    m = doc_multiple(cfg)
    ids = [tuple(u for r in rows[i : i + micro] for u in r) if docs.group > 1 else None
           for i in range(0, len(rows), micro)]  # fmt: skip
    return [make_microbatch(g, w, pad_id, m, tags, pair_ids)
            for g, w, (_, tags), pair_ids in zip(groups, widths, laid, ids)]  # fmt: skip


class TrainLoader:
    """This DP rank's micro-batches, step after step, from the endless deterministic stream."""

    def __init__(self, cfg, docs: Docs, counts: list[int], pad_id: int, dp_rank: int, dp_size: int):
        t = cfg.train
        per_rank = t.global_batch_size // dp_size
        if t.global_batch_size % (t.micro_batch_size * dp_size):
            raise FtcoreError(
                f"global batch {t.global_batch_size} is not divisible by micro batch {t.micro_batch_size} x dp {dp_size}",
                field="train.global_batch_size",
                fix="pick a global batch that is a multiple of micro_batch_size * dp",
            )
        self.docs, self.pad_id, self.seq_len = docs, pad_id, cfg.data.seq_len
        self.global_batch, self.dp_rank, self.per_rank = t.global_batch_size, dp_rank, per_rank
        lengths = per_sample(packing_lengths(cfg, doc_lengths(docs.docs)), docs.group)
        self.sampler = Sampler(
            docs.source_ids, counts, lengths, cfg.data.seq_len, cfg.data.packing, cfg.run.seed
        )
        self.cfg = cfg
        self.end = None  # the stream position train.epochs ends at (set_steps_from_epochs)
        self.pin = pin_host_batches(cfg.cluster.device)
        self.report = self._report()

    def _report(self) -> dict:
        ids = self.sampler.epoch_docs(0)  # the samples of epoch 0's rows, in another order
        g = self.docs.group
        rows = len(self.sampler.rows(0))
        slots = rows * self.seq_len * (1 if self.cfg.data.packing else g)  # unpacked pair: 2 rows
        tokens = int(per_sample(doc_lengths(self.docs.docs), g)[ids].sum())
        targets = int(per_sample(doc_learn(self.docs.docs), g)[ids].sum())
        return {
            "samples": len(ids),
            "unit": "pairs" if g > 1 else "samples",
            "tokens": tokens,
            "target_tokens": targets,
            "dropped": self.docs.dropped,
            "truncated": self.docs.truncated,
            "bad_records": self.docs.bad_records,
            "rows": rows,
            # target tokens / slots (the benchmarks' recorded field keeps this meaning); the log's
            # "packing efficiency" is slot_fill, the share of slots holding tokens
            "packing_efficiency": targets / max(1, slots),
            "slot_fill": tokens / max(1, slots),
        }

    def next_rows(self) -> list[list[int]]:
        """This rank's rows of the next global batch (the whole global batch is consumed)."""
        rows = self.sampler.take(self.global_batch, self.end)
        return rows[self.dp_rank * self.per_rank : (self.dp_rank + 1) * self.per_rank]

    def next_microbatches(self) -> list[MicroBatch]:
        """The next step's micro-batches; for a CUDA device in pinned memory, so their copies to
        it need no host sync (data/transfer.py). Only a step's worth is pinned at a time: the
        evaluation batches, kept for the whole run, stay in pageable memory."""
        mbs = assemble(self.cfg, self.docs, self.next_rows(), self.pad_id)
        return [mb.pin_memory() for mb in mbs] if self.pin else mbs

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, d: dict) -> None:
        self.sampler.load_state_dict(d)


def log_report(report: dict, what: str = "train") -> None:
    r = report
    log.info(
        "data (%s): %d %s, %d tokens, %d target tokens, %d rows; dropped %d, truncated %d, bad records %d; "
        "packing efficiency %.1f%% (of the rows' token slots; %.1f%% hold loss targets)",
        what,
        r["samples"],
        r.get("unit", "samples"),
        r["tokens"],
        r["target_tokens"],
        r["rows"],
        r["dropped"],
        r["truncated"],
        r["bad_records"],
        100 * r["slot_fill"],
        100 * r["packing_efficiency"],
    )
    if r["dropped"] and r.get("unit") == "pairs":
        log.warning("%d preference pairs dropped (the first named above, with the rule): a prompt "
                    "that fills data.seq_len (as TRL drops it), a sequence over it with "
                    "data.truncate=drop, or, packed, two sequences longer than a row together; "
                    "raise data.seq_len to keep them", r["dropped"])  # fmt: skip


def _rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def build_train_loader(cfg, tokenizer, dp_rank: int, dp_size: int) -> TrainLoader:
    _check(cfg)
    docs, counts = _load_train(cfg, tokenizer)
    loader = TrainLoader(cfg, docs, counts, tokenizer.pad_token_id, dp_rank, dp_size)
    if _rank0():
        log_report(loader.report)
    return loader


REPEAT_WARNING = 3  # epochs above which a run is warned that it may memorise its data


def set_steps_from_epochs(cfg, rows: int, loader: TrainLoader | None = None) -> None:
    """`train.epochs` -> `train.max_steps` (each step takes global_batch_size rows of the stream;
    a row is one sample, or several packed ones), and a warning when the run repeats its data
    many times (whether the step count came from epochs or was given). With the loader, epochs
    are exact: the last step takes only what is left of the last epoch (its other rows are empty,
    no loss), so 40 records at a global batch of 16 train on each record once for epochs=1."""
    t = cfg.train
    if t.epochs is not None and loader is not None:
        loader.end = loader.sampler.end_of(t.epochs)
        total = loader.sampler.rows_before(loader.end)
        t.max_steps = max(1, math.ceil(total / t.global_batch_size))
        epochs = float(t.epochs)
        partial = total % t.global_batch_size
        if _rank0():
            last = f"; the last step takes the {partial} rows left" if partial else ""
            log.info("train.epochs=%g: %d steps over %d rows (%d per epoch)%s%s", t.epochs,
                     t.max_steps, total, rows, last, _pairs_note(cfg, loader))  # fmt: skip
    else:
        if t.epochs is not None:
            t.max_steps = max(1, math.ceil(t.epochs * rows / t.global_batch_size))
        epochs = t.max_steps * t.global_batch_size / max(1, rows)
        if _rank0():
            log.info("%d steps x %d rows = %.2f epochs of %d training rows%s", t.max_steps,
                     t.global_batch_size, epochs, rows, _pairs_note(cfg, loader))  # fmt: skip
    if _rank0() and epochs > REPEAT_WARNING:
        log.warning("the run repeats its training data %.1f times (more than %d): it may "
                    "memorise it; fewer steps (train.epochs / train.max_steps) or more data "
                    "may generalise better", epochs, REPEAT_WARNING)  # fmt: skip


def _pairs_note(cfg, loader: TrainLoader | None) -> str:
    """Packed preference data: train.global_batch_size counts packed rows of whole pairs, not
    pairs (docs/preference.md); say how many pairs that makes a step."""
    if loader is None or loader.report.get("unit") != "pairs" or not cfg.data.packing:
        return ""
    r = loader.report
    per_row = r["samples"] / max(1, r["rows"])
    return (f" (packed: a row holds {per_row:.1f} of the {r['samples']} pairs on average, so a "
            f"step of {cfg.train.global_batch_size} rows trains ~{per_row * cfg.train.global_batch_size:.0f} pairs; "
            "data.packing=false makes train.global_batch_size count pairs)")  # fmt: skip


def _val_docs(cfg, tokenizer, path: str | None) -> Docs:
    docs = Docs()
    if path is None and cfg.data.val_path:
        path = cfg.data.val_path
    if path is not None:
        tok = tokenize_source(path, tokenizer, cfg.data, None, "data.val_path")
        picks = [np.arange(tok.samples)]
        toks = [tok]
    elif cfg.data.val_fraction > 0:
        toks = [
            tokenize_source(p, tokenizer, cfg.data, f, fld) for p, _, f, fld in train_sources(cfg)
        ]
        picks = [held_out_split(t.samples, cfg)[1] for t in toks]
    elif not cfg.data.path and not cfg.data.mix:
        val = bundled_data("val", cfg.data.format)
        toks = [tokenize_source(val, tokenizer, cfg.data, None, "data.val_path")]
        picks = [np.arange(toks[0].samples)]
    else:
        return docs
    for tok, p in zip(toks, picks):
        docs.bad_records += tok.bad_records
        d = cfg.data
        docs.source_ids.append(truncate(docs, tok, p, d.seq_len, d.truncate, fits(cfg, tok.group)))
    max_samples = cfg.eval.get("max_samples")
    if max_samples:
        docs.docs = docs.docs[: max_samples * docs.group]
    return docs


def build_val_batches(
    cfg, tokenizer, dp_rank: int, dp_size: int, path: str | None = None
) -> list[list[MicroBatch]]:
    """Eval global batches in a fixed order; each is this rank's micro-batches. The last global
    batch is filled up with all-padding rows, so every rank runs the same number of micro-batches."""
    _check(cfg)
    docs = _val_docs(cfg, tokenizer, path)
    if not docs.docs:
        return []
    if cfg.data.packing:
        rows = [sorted(b) for b in _pack(cfg, docs)]
        rows.sort(key=lambda r: r[0])
    else:
        rows = [[i] for i in range(docs.samples)]
    g = cfg.train.global_batch_size
    per_rank = g // dp_size
    rows += [[] for _ in range(-len(rows) % g)]
    return [
        assemble(
            cfg,
            docs,
            rows[k + dp_rank * per_rank : k + (dp_rank + 1) * per_rank],
            tokenizer.pad_token_id,
        )  # fmt: skip
        for k in range(0, len(rows), g)
    ]


def _pack(cfg, docs: Docs) -> list[list[int]]:
    from ftcore.data.packing import pack

    lengths = per_sample(packing_lengths(cfg, doc_lengths(docs.docs)), docs.group)
    return pack(lengths.tolist(), cfg.data.seq_len)
