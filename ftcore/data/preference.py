"""`data.format=preference`: a preference record -> its chosen and rejected sequences, as TRL does.

TRL 1.x (`DPOTrainer._prepare_dataset`) defines the token ids, and ftcore gives the same ones so a
run's numbers can be checked against `DPOTrainer`:

- standard records (`prompt`, `chosen`, `rejected` strings): the EOS token is appended as text to
  each completion that does not already end with it; `prompt`, `prompt + chosen` and
  `prompt + rejected` are each tokenized whole, with the tokenizer's special tokens.
- conversational records (three message lists): `apply_chat_template(prompt,
  add_generation_prompt=True)`, `apply_chat_template(prompt + chosen)` and
  `apply_chat_template(prompt + rejected)`, tokenized; no EOS is added.
- the completion starts at the shorter of the two common prefixes of the prompt's ids with the
  ids of prompt + chosen and prompt + rejected (a template or a BPE merge may change the prompt's
  last tokens), so the sequences are the whole prompt + completion ids, the targets the tokens
  from there on.

A pair is stored as two consecutive documents (chosen, then rejected) and everything downstream
keeps them together (data/pairs.py). Records that cannot give a usable pair are BadRecords (exit
2 naming the file and line, or a counted skip with data.on_bad_record=skip): a missing or
non-string field, an empty completion, a completion that tokenizes to nothing after the prompt,
and chosen identical to rejected (its loss has no gradient: a data error, not a signal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ftcore.data.templates import BadRecord, Doc, to_messages

FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class Pair:
    """The two documents of one preference record: prompt + chosen, prompt + rejected."""

    chosen: Doc
    rejected: Doc

    @property
    def docs(self) -> tuple[Doc, Doc]:
        return self.chosen, self.rejected


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def _fields(rec) -> tuple[object, object, object]:
    if not isinstance(rec, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(rec).__name__}")
    for key in FIELDS:
        if rec.get(key) is None:
            raise BadRecord(f'missing field "{key}" (a preference record has {", ".join(FIELDS)})')
    return rec["prompt"], rec["chosen"], rec["rejected"]


def _empty(value) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return not value or all(
        not str(m.get("content", "")).strip() for m in value if isinstance(m, dict)
    )


def sequences(renderer, rec) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, prompt + chosen ids, prompt + rejected ids) of a record, as TRL tokenizes."""
    prompt, chosen, rejected = _fields(rec)
    kinds = {type(v).__name__ for v in (prompt, chosen, rejected)}
    if kinds not in ({"str"}, {"list"}):
        raise BadRecord(
            '"prompt", "chosen" and "rejected" must be all strings or all message lists'
        )
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if _empty(value):
            raise BadRecord(f'the "{key}" completion is empty')
    if kinds == {"str"}:
        tok, eos = renderer.tok, renderer.tok.eos_token
        if eos:
            chosen = chosen if chosen.endswith(eos) else chosen + eos
            rejected = rejected if rejected.endswith(eos) else rejected + eos
        return [
            list(tok(text)["input_ids"]) for text in (prompt, prompt + chosen, prompt + rejected)
        ]
    if not prompt:
        raise BadRecord('"prompt" is an empty message list')
    for value in (chosen, rejected):  # roles and contents checked as chat records are
        to_messages({"messages": prompt + value}, "chat")
    return [
        _chat_ids(renderer, prompt, True),
        _chat_ids(renderer, prompt + chosen, False),
        _chat_ids(renderer, prompt + rejected, False),
    ]


def _chat_ids(renderer, messages: list, generation_prompt: bool) -> list[int]:
    """apply_chat_template(..., tokenize=True), TRL's call, with data.chat_template's template."""
    if renderer.template is None:
        raise BadRecord("message lists need a chat template (data.chat_template)")
    try:
        out = renderer.tok.apply_chat_template(
            messages,
            chat_template=renderer.template,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=generation_prompt,
        )
    except Exception as e:  # jinja raises from inside templates (e.g. roles must alternate)
        raise BadRecord(f"the chat template failed: {type(e).__name__}: {e}") from e
    return list(out["input_ids"])


def pair(renderer, rec) -> Pair:
    """A preference record as its Pair; BadRecord when it cannot be one."""
    prompt_ids, chosen_ids, rejected_ids = sequences(renderer, rec)
    start = min(
        common_prefix_length(prompt_ids, chosen_ids), common_prefix_length(prompt_ids, rejected_ids)
    )
    if chosen_ids == rejected_ids:
        raise BadRecord('"chosen" and "rejected" are identical (the pair teaches nothing)')
    docs = []
    for key, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        targets = np.zeros(len(ids), bool)
        targets[start:] = True
        if not targets[1:].any():  # the first token is never predicted (nothing before it)
            raise BadRecord(f'the "{key}" completion has no token to learn after the prompt')
        docs.append(Doc(np.asarray(ids, np.int32), targets))
    return Pair(*docs)
