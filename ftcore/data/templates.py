"""Records -> chat messages -> rendered turns -> token ids with a per-token target flag.

The loss mask comes from the rendered turns themselves, never from `{% generation %}` markers:
rendering the conversation prefix by prefix, each new piece of text belongs to exactly one turn,
and an assistant turn splits into its header (the generation prompt, not a target) and its body
(the targets). A template whose renders are not prefixes of each other, or that ignores
`add_generation_prompt`, cannot be split: that is an error, never a silent train-on-everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ftcore.errors import FtcoreError

# Llama 3: bos once, then <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> per turn.
LLAMA3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.index0 == 0 %}{{- bos_token }}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# ChatML: <|im_start|>role\ncontent<|im_end|>\n per turn.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BUILTIN_TEMPLATES = {"llama3": LLAMA3_TEMPLATE, "chatml": CHATML_TEMPLATE}
ROLES = ("system", "user", "assistant")
FORMATS = ("instruction", "chat", "text")


class BadRecord(ValueError):
    """A record that cannot become a training sample; the caller adds the file and line."""


@dataclass
class Doc:
    """One tokenized sample. targets[t] is True when ids[t] is a token the model must predict."""

    ids: np.ndarray  # int32
    targets: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.ids)


def resolve_template(tokenizer, name: str | None) -> str:
    """data.chat_template: null (the tokenizer's own), llama3, chatml, or a file holding a template."""
    if name is None:
        tmpl = getattr(tokenizer, "chat_template", None)
        if isinstance(tmpl, dict):
            tmpl = tmpl.get("default")
        if not tmpl:
            raise FtcoreError(
                "the tokenizer has no chat template",
                field="data.chat_template",
                fix="set data.chat_template=llama3, chatml or a path to a Jinja template file",
            )
        return tmpl
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name]
    path = Path(name).expanduser()
    if not path.is_file():
        raise FtcoreError(
            f"{name} is neither a built-in template nor a file",
            field="data.chat_template",
            fix=f"use one of {', '.join(BUILTIN_TEMPLATES)} or a path to a Jinja template file",
        )
    return path.read_text(encoding="utf-8")


def _string(rec: dict, key: str, *, required: bool = True) -> str | None:
    if key not in rec or rec[key] is None:
        if required:
            raise BadRecord(f'missing field "{key}"')
        return None
    if not isinstance(rec[key], str):
        raise BadRecord(f'field "{key}" must be a string, got {type(rec[key]).__name__}')
    return rec[key]


def to_messages(rec, fmt: str) -> list[dict]:
    """An `instruction` or `chat` record as a checked list of {"role", "content"} messages."""
    if not isinstance(rec, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(rec).__name__}")
    if fmt == "instruction":
        instruction, output = _string(rec, "instruction"), _string(rec, "output")
        inp, system = _string(rec, "input", required=False), _string(rec, "system", required=False)
        user = instruction + (f"\n\n{inp}" if inp else "")
        msgs = [{"role": "system", "content": system}] if system else []
        return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    messages = rec.get("messages")
    if messages is None:
        raise BadRecord('missing field "messages"')
    if not isinstance(messages, list) or not messages:
        raise BadRecord('"messages" must be a non-empty list of {"role", "content"} objects')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRecord(f"messages[{i}] must be an object, got {type(m).__name__}")
        role, content = _string(m, "role"), _string(m, "content")
        if role not in ROLES:
            raise BadRecord(
                f'messages[{i}] has unknown role "{role}" (expected {", ".join(ROLES)})'
            )
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord("the conversation has no assistant turn (nothing to train on)")
    return out


class Renderer:
    """Turns records into Docs with one tokenizer, template and masking policy."""

    def __init__(self, tokenizer, fmt: str, template: str | None, train_on_prompt: bool = False):
        if fmt not in FORMATS:
            raise FtcoreError(
                f"unknown format {fmt}", field="data.format", fix=f"use one of {', '.join(FORMATS)}"
            )
        self.tok, self.fmt, self.train_on_prompt = tokenizer, fmt, train_on_prompt
        self.template = resolve_template(tokenizer, template) if fmt != "text" else None
        # text format: tokenizer(text)["input_ids"] + [eos_token_id], as the eval contract pins it
        self.text_eos = tokenizer.eos_token_id

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        try:
            return self.tok.apply_chat_template(
                messages,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as e:  # jinja raises from inside templates (e.g. roles must alternate)
            raise BadRecord(f"the chat template failed: {type(e).__name__}: {e}") from e

    def segments(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """The rendered conversation cut into (text, is_target) pieces, one turn at a time."""
        try:
            prev = self.render([])
        except BadRecord:
            prev = ""
        segs: list[tuple[str, bool]] = [(prev, False)]
        for k, msg in enumerate(messages):
            if msg["role"] == "assistant":
                gen = self._extend(
                    prev, self.render(messages[:k], True), k, "the generation prompt"
                )
                if gen == prev:
                    raise FtcoreError(
                        "the chat template ignores add_generation_prompt, so the assistant header "
                        "cannot be separated from the assistant's answer",
                        field="data.chat_template",
                        fix="use a template with add_generation_prompt, or data.chat_template=llama3|chatml",
                    )
                full = self._extend(gen, self.render(messages[: k + 1]), k, "the assistant turn")
                body = full[len(gen) :]
                answer = body.rstrip()  # whitespace after the end-of-turn token is not a target
                segs += [
                    (gen[len(prev) :], self.train_on_prompt),
                    (answer, True),
                    (body[len(answer) :], False),
                ]
            else:
                full = self._extend(
                    prev, self.render(messages[: k + 1]), k, f"the {msg['role']} turn"
                )
                segs.append((full[len(prev) :], self.train_on_prompt))
            prev = full
        return [(t, m) for t, m in segs if t]

    def _extend(self, prefix: str, text: str, k: int, what: str) -> str:
        if not text.startswith(prefix):
            raise FtcoreError(
                f"the chat template cannot be split into turns: rendering message {k} ({what}) changes "
                "the text rendered for the messages before it, so the loss mask cannot be computed",
                field="data.chat_template",
                fix="use a template that renders each turn independently, or data.chat_template=llama3|chatml",
            )
        return text

    def prompt(self, rec) -> tuple[list[int], str]:
        """(prompt ids up to the last assistant turn's generation prompt, that turn's answer): what
        exact-match accuracy generates from and compares against."""
        msgs = to_messages(rec, self.fmt)
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        text = self.render(msgs[:last], True)
        return list(self.tok(text, add_special_tokens=False)["input_ids"]), msgs[last]["content"]

    def doc(self, rec) -> Doc:
        """A record as token ids and target flags; raises BadRecord for bad records."""
        if self.fmt == "text":
            if not isinstance(rec, dict):
                raise BadRecord(f"a record must be a JSON object, got {type(rec).__name__}")
            ids = list(self.tok(_string(rec, "text"), add_special_tokens=True)["input_ids"])
            if self.text_eos is not None:
                ids.append(self.text_eos)
            return Doc(np.asarray(ids, np.int32), np.ones(len(ids), bool))
        segs = self.segments(to_messages(rec, self.fmt))
        enc = self.tok([t for t, _ in segs], add_special_tokens=False)["input_ids"]
        ids = np.fromiter((i for piece in enc for i in piece), np.int32)
        targets = np.concatenate([np.full(len(piece), m, bool) for piece, (_, m) in zip(enc, segs)])
        return Doc(ids, targets)
