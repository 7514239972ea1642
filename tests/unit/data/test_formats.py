"""data.format=auto: the records' shape picks the format, said in one line; a file of no known
shape is refused naming the shapes; an explicit format wins. prompt_completion strings are
tokenized as TRL's SFT trainer tokenizes them (prompt + completion + eos, loss on the rest after
len(tokenize(prompt)) ids), message lists through the chat template."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoTokenizer

from ftcore.config.schema import compose
from ftcore.data import formats
from ftcore.data.templates import Renderer
from ftcore.data.tokenizer import bundled_tokenizer_dir
from ftcore.errors import FtcoreError

Q = {"role": "user", "content": "What is 2 + 3?"}
A = {"role": "assistant", "content": "5"}
RECORDS = {
    "chat": {"messages": [Q, A]},
    "prompt_completion": {"prompt": "What is 2 + 3? ", "completion": "5"},
    "instruction": {"instruction": "What is 2 + 3?", "output": "5"},
    "text": {"text": "2 + 3 = 5"},
}


def _write(path, rec, n=3):
    path.write_text("".join(json.dumps(rec) + "\n" for _ in range(n)))
    return str(path)


@pytest.mark.parametrize("fmt", list(RECORDS))
def test_auto_detects_and_says_so(tmp_path, caplog, fmt):
    cfg = compose(["+exp=tiny_lora", f"data.path={_write(tmp_path / 'd.jsonl', RECORDS[fmt])}"])
    assert cfg.data.format == "auto"
    with caplog.at_level(logging.INFO, logger="ftcore"):
        formats.resolve(cfg)
    assert (
        cfg.data.format == fmt and f"data.format=auto: {tmp_path / 'd.jsonl'}: {fmt}" in caplog.text
    )


def test_no_known_shape_is_refused_naming_the_shapes(tmp_path):
    cfg = compose(["+exp=tiny_lora", f"data.path={_write(tmp_path / 'd.jsonl', {'q': 1, 'a': 2})}"])
    with pytest.raises(FtcoreError) as e:
        formats.resolve(cfg)
    msg = str(e.value)
    assert "(a, q) has none of the shapes" in msg and "fix:" in msg
    for fmt, _, shape in formats.SHAPES:
        assert f"{fmt} {shape}" in msg


def test_explicit_format_wins(tmp_path):
    path = _write(tmp_path / "d.jsonl", RECORDS["chat"])
    cfg = compose(["+exp=tiny_lora", f"data.path={path}", "data.format=text"])
    formats.resolve(cfg)
    assert cfg.data.format == "text"


def test_prompt_completion_as_trl_tokenizes_it():
    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_dir())
    r = Renderer(tok, "prompt_completion", None)
    doc = r.doc(RECORDS["prompt_completion"])
    p, c = RECORDS["prompt_completion"]["prompt"], RECORDS["prompt_completion"]["completion"]
    # TRL (sft_trainer.py): completion += eos; ids = tok(prompt + completion); the first
    # len(tok(prompt)) ids are the prompt
    want = tok(p + c + tok.eos_token)["input_ids"]
    n = len(tok(p)["input_ids"])
    assert doc.ids.tolist() == want
    assert doc.targets.tolist() == [False] * n + [True] * (len(want) - n)
    assert r.prompt(RECORDS["prompt_completion"]) == (tok(p)["input_ids"], c)
    # message lists: the chat template, as the same conversation in chat format
    lists = {"prompt": [Q], "completion": [A]}
    chat = Renderer(tok, "chat", None).doc(RECORDS["chat"])
    got = r.doc(lists)
    assert got.ids.tolist() == chat.ids.tolist() and got.targets.tolist() == chat.targets.tolist()
