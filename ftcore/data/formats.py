"""`data.format=auto` (the default): the shape of the records decides how they are rendered.

The first record of each training source is read (nothing is tokenized) and its keys choose:
`chosen` + `rejected` -> preference (TRL's preference format, data/preference.py), `messages` ->
chat, `prompt` + `completion` -> prompt_completion (TRL's prompt-completion format),
`instruction` + `output` -> instruction, `text` -> text, `prompt` alone -> prompt (TRL's
prompt-only format, objective=grpo's data: data/prompt_set.py). A file whose first record has none of
these is refused with the accepted shapes listed. An explicit `data.format` (or a mix
entry's own `format`) is used as given; a later record of another shape is a bad record
(`data.on_bad_record`).
"""

from __future__ import annotations

import logging

from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")

# (format, the keys that make it, how the shape is written for a user)
SHAPES = (
    ("preference", ("chosen", "rejected"), '{"prompt": ..., "chosen": ..., "rejected": ...}'),
    ("chat", ("messages",), '{"messages": [{"role": ..., "content": ...}, ...]}'),
    ("prompt_completion", ("prompt", "completion"), '{"prompt": ..., "completion": ...}'),
    ("instruction", ("instruction", "output"), '{"instruction": ..., "output": ...}'),
    ("text", ("text",), '{"text": ...}'),
    ("prompt", ("prompt",), '{"prompt": ...} (objective=grpo)'),
)
ACCEPTED = "; ".join(f"{fmt} {shape}" for fmt, _, shape in SHAPES)


def detect(rec) -> str | None:
    """The format a record's keys name, or None."""
    if not isinstance(rec, dict):
        return None
    for fmt, keys, _ in SHAPES:
        if all(k in rec for k in keys):
            return fmt
    return None


def detect_source(path: str, field: str = "data.path") -> str:
    """The format of a source's first readable record; FtcoreError naming the shapes if it has
    none of them."""
    from ftcore.data import sources

    for where, rec in sources.iter_records(sources.resolve(path, field)):
        if isinstance(rec, Exception):
            continue  # unreadable: the tokenizer's pass reports it under data.on_bad_record
        fmt = detect(rec)
        if fmt is None:
            keys = ", ".join(sorted(rec)) if isinstance(rec, dict) else type(rec).__name__
            raise FtcoreError(
                f"{where}: the record ({keys}) has none of the shapes ftcore reads: {ACCEPTED}",
                field=field,
                fix="write the records in one of these shapes, or name the format with "
                "data.format=instruction|chat|prompt_completion|text|preference|prompt",
            )
        return fmt
    return "instruction"  # nothing readable: the tokenizer's pass reports each record


def resolve(cfg, say: bool = True, kind: str = "train") -> None:
    """Replace `auto` in data.format (and in mix entries without their own format) by what the
    records show, saying which it chose; explicit formats are kept. `kind` "eval": the records
    ftcore.eval reads (data.path, else the validation file); "generate" reads no records and
    leaves `auto` (its prompt is rendered as an instruction)."""
    from ftcore.config.schema import assets_dir

    d = cfg.data
    if d.format != "auto" or kind == "generate":
        return
    chosen = []
    if d.mix:
        for i, m in enumerate(d.mix):
            if m.get("format") in (None, "auto"):
                m.format = detect_source(m.path, f"data.mix[{i}].path")
                chosen.append(f"{m.path}: {m.format}")
        d.format = d.mix[0].format
    else:
        objective = (cfg.get("objective") or {}).get("name")  # its bundled sample (bundled_data)
        split = "val" if kind == "eval" else "train"  # eval reads the validation file
        name = {"dpo": f"preference_{split}", "grpo": f"prompts_{split}"}.get(objective, split)
        path = (
            d.path
            or (kind == "eval" and d.val_path)
            or str(assets_dir() / "data" / f"{name}.jsonl")
        )
        d.format = detect_source(path)
        chosen.append(f"{path}: {d.format}")
    if d.val_path:  # validation records are rendered as the training ones are
        fmt = detect_source(d.val_path, "data.val_path")
        if fmt != d.format:
            raise FtcoreError(
                f"{d.val_path} holds {fmt} records but the training data is {d.format}",
                field="data.val_path",
                fix="validation data in the training data's shape",
            )
    if say:
        log.info("data.format=auto: %s (from the first record)", "; ".join(chosen))


def check_preference(cfg) -> None:
    """Preference pairs go with the DPO objective and nothing else (a source of another format
    in the mix, the prompt trained on, or the SFT loss on both completions would be wrong)."""
    d = cfg.data
    formats = {d.format} | {m.get("format") or d.format for m in d.mix or []}
    objective = (cfg.get("objective") or {}).get("name")
    if "preference" not in formats:
        if objective == "dpo" and formats != {"auto"}:  # auto: checked once the records show it
            raise FtcoreError(f"objective=dpo trains on preference pairs, not {d.format} records",
                              field="data.format", fix="data.format=preference (records with "
                              "prompt, chosen and rejected)")  # fmt: skip
        return
    if len(formats - {"auto"}) > 1:
        raise FtcoreError(f"preference data mixed with {', '.join(sorted(formats - {'preference'}))}",
                          field="data.mix", fix="give every source format=preference")  # fmt: skip
    if objective not in (None, "dpo"):
        raise FtcoreError(f"data.format=preference needs a preference objective, not {objective}",
                          field="objective", fix="objective=dpo")  # fmt: skip
    if d.train_on_prompt:
        raise FtcoreError("preference losses count completion tokens only",
                          field="data.train_on_prompt", fix="data.train_on_prompt=false")  # fmt: skip


def check_prompts(cfg) -> None:
    """Prompt-only records go with objective=grpo, and it with them (one source: data.path)."""
    d = cfg.data
    objective = (cfg.get("objective") or {}).get("name")
    if objective != "grpo":
        if d.format == "prompt" or any(m.get("format") == "prompt" for m in d.mix or []):
            raise FtcoreError(f"prompt-only records have nothing to learn from under objective={objective}",
                              field="data.format", fix="objective=grpo (with rewards), or records "
                              "with answers (data.format=instruction|chat|prompt_completion)")  # fmt: skip
        return
    if d.mix:
        raise FtcoreError("objective=grpo reads one prompt source", field="data.mix",
                          fix="data.path=PROMPTS.jsonl (the records of several files in one)")  # fmt: skip
    if d.format not in ("auto", "prompt"):
        raise FtcoreError(f"objective=grpo samples completions for prompts, not {d.format} records",
                          field="data.format", fix='data.format=prompt (records {"prompt": ...})')  # fmt: skip
