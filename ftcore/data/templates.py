"""Records -> chat messages -> rendered turns -> token ids with a per-token target flag.

The loss mask comes from the rendered turns themselves, never from `{% generation %}` markers:
rendering the conversation prefix by prefix, each new piece of text belongs to exactly one turn,
and an assistant turn splits into its header (the generation prompt, not a target) and its body
(the targets). A template whose renders are not prefixes of each other, or that ignores
`add_generation_prompt`, cannot be split: that is an error, never a silent train-on-everything.

The ids are those of the whole rendered text, tokenized once (what `apply_chat_template(...,
tokenize=True)` gives, and what a server gives the model); the pieces only decide which tokens are
targets, by character offsets. A prompt for generation is tokenized the same way, and a template
whose generation prompt tokenizes differently alone than followed by an answer is refused: the
model would be prompted with ids it never saw in training.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files

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
# Conversations every template is checked on before any data is read (see check_boundaries).
PROBES = (
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "It is 8."},
    ],
)
FORMATS = ("instruction", "chat", "prompt_completion", "text", "preference", "prompt")


class BadRecord(ValueError):
    """A record that cannot become a training sample; the caller adds the file and line."""


@dataclass
class Doc:
    """One tokenized sample. targets[t] is True when ids[t] is a token the model must predict."""

    ids: np.ndarray  # int32
    targets: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.ids)


def _headerless(body: str, content: str) -> bool:
    """An assistant turn with no header at all (Mistral's `[INST] q [/INST]` + answer + eos: the
    user turn ends where the answer starts, so the template needs no generation prompt): its text
    starts with the answer itself, up to whitespace, which then goes with the target."""
    return bool(content.strip()) and body.lstrip().startswith(content.strip())


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
    return safe_files.read_text(path, "data.chat_template", limit=1 << 20)


def describe_template(cfg, tokenizer) -> str:
    """Which chat template data.chat_template picks, for the log: a built-in, a file, or the
    tokenizer's own (named after the built-in it equals, if one)."""
    from ftcore.data.tokenizer import tokenizer_source

    name = cfg.data.chat_template
    if name in BUILTIN_TEMPLATES:
        return f"{name} (data.chat_template)"
    if name is not None:
        return f"{name} (data.chat_template, a file)"
    own = resolve_template(tokenizer, None)
    same = next((k for k, t in BUILTIN_TEMPLATES.items() if t == own), None)
    return (
        f"the tokenizer's own ({tokenizer_source(cfg)[0]}){f', the same as {same}' if same else ''}"
    )


def _string(rec: dict, key: str, *, required: bool = True) -> str | None:
    if key not in rec or rec[key] is None:
        if required:
            raise BadRecord(f'missing field "{key}"')
        return None
    if not isinstance(rec[key], str):
        raise BadRecord(f'field "{key}" must be a string, got {type(rec[key]).__name__}')
    return rec[key]


def to_messages(rec, fmt: str) -> list[dict]:
    """An `instruction`, `chat` or message-list `prompt_completion` record as a checked list of
    {"role", "content"} messages."""
    if not isinstance(rec, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(rec).__name__}")
    if fmt == "instruction":
        instruction, output = _string(rec, "instruction"), _string(rec, "output")
        inp, system = _string(rec, "input", required=False), _string(rec, "system", required=False)
        user = instruction + (f"\n\n{inp}" if inp else "")
        msgs = [{"role": "system", "content": system}] if system else []
        return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    if fmt == "prompt_completion":  # TRL's conversational prompt-completion: two message lists
        prompt, completion = rec.get("prompt"), rec.get("completion")
        if not isinstance(prompt, list) or not isinstance(completion, list):
            raise BadRecord('"prompt" and "completion" must both be strings or both message lists')
        return to_messages({"messages": prompt + completion}, "chat")
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
        self.template = None
        if fmt in (
            "prompt_completion",
            "preference",
            "prompt",
        ):  # strings need no template; lists do
            try:
                self.template = resolve_template(tokenizer, template)
            except FtcoreError:
                pass
        elif fmt != "text":
            self.template = resolve_template(tokenizer, template)
        # text format: tokenizer(text)["input_ids"] + [eos_token_id], as the eval contract pins it
        self.text_eos = tokenizer.eos_token_id
        if self.template is not None:
            self.check_boundaries()

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        if self.template is None:
            raise BadRecord("message lists need a chat template (data.chat_template)")
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
                full = self._extend(gen, self.render(messages[: k + 1]), k, "the assistant turn")
                if gen == prev and not _headerless(full[len(gen) :], msg["content"]):
                    raise FtcoreError(
                        "the chat template ignores add_generation_prompt, so the assistant header "
                        "cannot be separated from the assistant's answer",
                        field="data.chat_template",
                        fix="use a template with add_generation_prompt, or data.chat_template=llama3|chatml",
                    )
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

    def ids(self, text: str) -> list[int]:
        """The one tokenization of rendered text, for training and generation alike."""
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode(self, messages: list[dict]) -> Doc:
        """A conversation as the ids of its whole rendered text, with the tokens overlapping a
        target piece (the answers) flagged; a token straddling a piece boundary goes with the
        target, as `apply_chat_template(return_assistant_tokens_mask=True)` does."""
        segs = self.segments(messages)
        text = "".join(t for t, _ in segs)
        try:
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError as e:  # only slow (Python) tokenizers lack offsets
            raise FtcoreError(
                "chat data needs a fast tokenizer (one with a tokenizer.json)",
                field="model.hf_path",
                fix="save the tokenizer with tokenizer.json, or use data.format=text",
            ) from e
        ids = np.asarray(enc["input_ids"], np.int32)
        # character -> target flag, then a token is a target when any of its characters is
        is_target = np.zeros(len(text) + 1, bool)
        pos = 0
        for piece, target in segs:
            is_target[pos : pos + len(piece)] = target
            pos += len(piece)
        cum = np.concatenate([[0], np.cumsum(is_target[:-1])])
        off = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
        ends = np.maximum(off[:, 1], off[:, 0] + 1).clip(max=len(text))
        targets = cum[ends] > cum[off[:, 0]]
        return Doc(ids, targets)

    def check_boundaries(self) -> None:
        """Refuse a template whose generation prompt, tokenized alone (as for generation), is not
        the start of the ids of the same conversation with the answer (as trained on): e.g. one
        ending its generation prompt in a space that merges with the answer's first word."""
        for msgs in PROBES:
            try:
                self.render(msgs)
            except BadRecord:
                continue  # a template that refuses e.g. system messages: records will say so
            full = self.encode(msgs).ids.tolist()
            for k, msg in enumerate(msgs):
                if msg["role"] != "assistant":
                    continue
                prompt = self.ids(self.render(msgs[:k], True))
                if full[: len(prompt)] != prompt:
                    raise FtcoreError(
                        f"the chat template's generation prompt tokenizes differently alone "
                        f"({self.tok.convert_ids_to_tokens(prompt[-3:])} at its end) than followed by "
                        f"the answer ({self.tok.convert_ids_to_tokens(full[len(prompt) - 3 : len(prompt)])}),"
                        " so generation would start from ids the model was never trained on",
                        field="data.chat_template",
                        fix="end the generation prompt with a special token or a newline (no trailing "
                        "space), or use data.chat_template=llama3|chatml",
                    )

    def prompt(self, rec) -> tuple[list[int], str]:
        """(prompt ids up to the last assistant turn's generation prompt, that turn's answer): what
        exact-match accuracy and `ftcore.generate` generate from. Tokenized as `encode` does, so
        the ids are those the trained sequence starts with (check_boundaries)."""
        plain = self._plain_prompt_completion(rec)
        if plain is not None:
            return list(self.tok(plain[0])["input_ids"]), plain[1]
        msgs = to_messages(rec, self.fmt)
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        return self.ids(self.render(msgs[:last], True)), msgs[last]["content"]

    def doc(self, rec) -> Doc:
        """A record as token ids and target flags; raises BadRecord for bad records (preference
        records become pairs in render_pool.render_one)."""
        if self.fmt == "text":
            if not isinstance(rec, dict):
                raise BadRecord(f"a record must be a JSON object, got {type(rec).__name__}")
            ids = list(self.tok(_string(rec, "text"), add_special_tokens=True)["input_ids"])
            if self.text_eos is not None:
                ids.append(self.text_eos)
            return Doc(np.asarray(ids, np.int32), np.ones(len(ids), bool))
        plain = self._plain_prompt_completion(rec)
        if plain is not None:
            return self._prompt_completion(*plain)
        return self.encode(to_messages(rec, self.fmt))

    def _plain_prompt_completion(self, rec) -> tuple[str, str] | None:
        """(prompt, completion) of a prompt_completion record holding strings; None otherwise."""
        if self.fmt != "prompt_completion" or not isinstance(rec, dict):
            return None
        if isinstance(rec.get("prompt"), list) or isinstance(rec.get("completion"), list):
            return None
        return _string(rec, "prompt"), _string(rec, "completion")

    def _prompt_completion(self, prompt: str, completion: str) -> Doc:
        """As TRL's SFT trainer: plain text, the completion ending in the eos token, tokenized with
        the tokenizer's special tokens; the first len(tokenize(prompt)) ids are the prompt (no
        loss unless data.train_on_prompt), the rest the targets."""
        eos = self.tok.eos_token
        if eos and not completion.endswith(eos):
            completion += eos
        prompt_ids = self.tok(prompt)["input_ids"]
        ids = np.asarray(self.tok(prompt + completion)["input_ids"], np.int32)
        targets = np.ones(len(ids), bool)
        targets[: len(prompt_ids)] = self.train_on_prompt
        return Doc(ids, targets)
