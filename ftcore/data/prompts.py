"""The prompts and expected answers that exact-match accuracy generates from: the validation
data's records (or those data.val_fraction holds out of each training source), rendered as prompts."""

from __future__ import annotations

from ftcore.data import formats
from ftcore.data.pipeline import bundled_data, held_out_split, train_sources
from ftcore.errors import FtcoreError


def load_prompts(cfg, tokenizer, path: str | None = None) -> list[tuple[list[int], str]]:
    """(prompt ids, expected answer) per record of an instruction/chat file (default: the
    validation data of build_val_batches): the inputs of exact-match accuracy. Bad records follow
    data.on_bad_record."""
    from ftcore.data.templates import Renderer

    d = cfg.data
    if path is None and not d.val_path and (d.path or d.mix) and d.val_fraction > 0:
        return _held_out_prompts(cfg, tokenizer)
    path = path or d.val_path or (bundled_data("val") if not (d.path or d.mix) else None)
    if path is None:
        raise FtcoreError(
            "no data to compute accuracy on", field="data.val_path", fix="set data.val_path"
        )
    fmt = d.format if d.format != "auto" else formats.detect_source(path)
    return _prompts(cfg, Renderer(tokenizer, fmt, d.chat_template, d.train_on_prompt), path)


def _held_out_prompts(cfg, tokenizer) -> list[tuple[list[int], str]]:
    """The prompts of the documents data.val_fraction holds out of each training source: the
    same documents (held_out_split over the usable records, as tokenize_source counts them) the
    validation loss uses, never trained on. Text sources have no answers and give none."""
    from ftcore.data.templates import Renderer

    d, out = cfg.data, []
    for path, _, fmt, _ in train_sources(cfg):
        fmt = fmt or d.format
        fmt = fmt if fmt != "auto" else formats.detect_source(path)
        if fmt == "text":
            continue
        renderer = Renderer(tokenizer, fmt, d.chat_template, d.train_on_prompt)
        usable = _prompts(cfg, renderer, path, limit=d.max_samples, docs_only=True)
        out += [usable[i] for i in held_out_split(len(usable), cfg)[1]]
    return out


def _prompts(cfg, renderer, path: str, *, limit: int | None = None, docs_only: bool = False):
    """(prompt ids, answer) per usable record of path; `docs_only`: a usable record is one that
    tokenizes as a training document (the held-out split counts those)."""
    from ftcore.data import sources
    from ftcore.data.templates import BadRecord

    out = []
    for where, rec in sources.iter_records(sources.resolve(path)):
        if limit is not None and len(out) >= limit:
            break
        try:
            if isinstance(rec, Exception):
                raise rec
            if docs_only:
                renderer.doc(rec)
            out.append(renderer.prompt(rec))
        except (BadRecord, sources.RecordError) as e:
            if cfg.data.on_bad_record != "skip":
                raise FtcoreError(
                    f"{where}: {e}", field="data.path", fix="fix or remove the record"
                ) from None
    return out
