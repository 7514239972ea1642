"""Loss masks, token by token, against hand-written expectations.

Each expected sequence is written as pieces of text with their target flag, tokenized piece by
piece; the renderer must produce exactly those ids and flags. Llama-3-style (the bundled
tokenizer's own template) and ChatML-style templates; multi-turn chats and system prompts; the
prompt-training option; templates that cannot be split into turns are refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from ftcore.data.templates import CHATML_TEMPLATE, BadRecord, Renderer
from ftcore.data.tokenizer import bundled_tokenizer_dir
from ftcore.errors import FtcoreError

SH, EH, EOT, BOS = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()))


@pytest.fixture(scope="module")
def chatml_tok():
    """The bundled tokenizer with ChatML's special tokens and template as its own."""
    t = AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()))
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = CHATML_TEMPLATE
    return t


def expect(tok, pieces):
    ids, flags = [], []
    for text, target in pieces:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        flags += [target] * len(piece)
    return ids, flags


def check(tok, renderer, rec, pieces):
    doc = renderer.doc(rec)
    ids, flags = expect(tok, pieces)
    assert doc.ids.tolist() == ids, (
        tok.convert_ids_to_tokens(doc.ids.tolist()),
        tok.convert_ids_to_tokens(ids),
    )
    assert doc.targets.tolist() == flags
    return doc


def llama(role, content):
    return [(f"{SH}{role}{EH}\n\n{content}{EOT}", False)]


def test_llama3_instruction(tok):
    r = Renderer(tok, "instruction", None)
    rec = {"instruction": "Reverse the letters of the word.", "input": "apple", "output": "elppa"}
    doc = check(
        tok,
        r,
        rec,
        [(BOS, False)]
        + llama("user", "Reverse the letters of the word.\n\napple")
        + [(f"{SH}assistant{EH}\n\n", False), ("elppa", True), (EOT, True)],
    )
    # and explicitly: the targets are exactly the answer's tokens and the end-of-turn token
    targets = doc.ids[doc.targets].tolist()
    assert tok.decode(targets) == "elppa<|eot_id|>"


def test_llama3_multiturn_with_system(tok):
    r = Renderer(tok, "chat", "llama3")
    msgs = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 * 3?"},
        {"role": "assistant", "content": "9"},
    ]
    check(
        tok,
        r,
        {"messages": msgs},
        [(BOS, False)]
        + llama("system", "Answer with a number.")
        + llama("user", "What is 2 + 2?")
        + [(f"{SH}assistant{EH}\n\n", False), ("4", True), (EOT, True)]
        + llama("user", "And 3 * 3?")
        + [(f"{SH}assistant{EH}\n\n", False), ("9", True), (EOT, True)],
    )


def test_llama3_instruction_system_field_and_train_on_prompt(tok):
    rec = {"system": "Be brief.", "instruction": "What is 1 + 1?", "output": "2"}
    r = Renderer(tok, "instruction", "llama3", train_on_prompt=True)
    doc = r.doc(rec)
    assert doc.targets.all()
    r = Renderer(tok, "instruction", "llama3")
    check(
        tok,
        r,
        rec,
        [(BOS, False)]
        + llama("system", "Be brief.")
        + llama("user", "What is 1 + 1?")
        + [(f"{SH}assistant{EH}\n\n", False), ("2", True), (EOT, True)],
    )


def test_chatml_multiturn_with_system(chatml_tok):
    tok = chatml_tok
    r = Renderer(tok, "chat", None)  # the tokenizer's own (ChatML) template
    msgs = [
        {"role": "system", "content": "You sort words."},
        {"role": "user", "content": "pear apple"},
        {"role": "assistant", "content": "apple pear"},
        {"role": "user", "content": "fig date"},
        {"role": "assistant", "content": "date fig"},
    ]
    doc = check(
        tok,
        r,
        {"messages": msgs},
        [
            ("<|im_start|>system\nYou sort words.<|im_end|>\n", False),
            ("<|im_start|>user\npear apple<|im_end|>\n", False),
            ("<|im_start|>assistant\n", False),
            ("apple pear<|im_end|>", True),
            ("\n", False),
            ("<|im_start|>user\nfig date<|im_end|>\n", False),
            ("<|im_start|>assistant\n", False),
            ("date fig<|im_end|>", True),
            ("\n", False),
        ],
    )
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert doc.ids[doc.targets].tolist().count(im_end) == 2


def test_chatml_by_name_on_llama_tokenizer(tok):
    """data.chat_template=chatml on a tokenizer without ChatML tokens: the markers are plain text."""
    r = Renderer(tok, "instruction", "chatml")
    check(
        tok,
        r,
        {"instruction": "What is 5 - 7?", "output": "-2"},
        [
            ("<|im_start|>user\nWhat is 5 - 7?<|im_end|>\n", False),
            ("<|im_start|>assistant\n", False),
            ("-2<|im_end|>", True),
            ("\n", False),
        ],
    )


def test_generation_markers_do_not_matter(tok):
    """A template with {% generation %} blocks gives the same mask as the plain one."""
    marked = (
        "{%- for m in messages %}{%- if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
        "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
        "{%- if m['role'] == 'assistant' %}{% generation %}{{- m['content'] + '<|eot_id|>' }}{% endgeneration %}"
        "{%- else %}{{- m['content'] + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    )
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}
    a = Renderer(tok, "chat", "llama3").doc(rec)
    b = Renderer(tok, "chat", None)
    b.template = marked
    b = b.doc(rec)
    assert a.ids.tolist() == b.ids.tolist() and a.targets.tolist() == b.targets.tolist()


def test_text_format_every_token_a_target(tok):
    doc = Renderer(tok, "text", None).doc({"text": "cat dog bird"})
    assert doc.ids[0] == tok.bos_token_id
    assert doc.ids[-1] == tok.eos_token_id  # tokenizer(text)["input_ids"] + [eos_token_id]
    assert doc.targets.all()


def _renderer_with(tok, template):
    r = Renderer(tok, "chat", "llama3")
    r.template = template
    return r


REC = {
    "messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
}


def test_template_that_rewrites_earlier_turns_is_refused(tok):
    # Renders the last message differently from the others: prefixes do not extend each other.
    tmpl = (
        "{%- for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
        "{%- if loop.last %}{{ ' [end]' }}{% else %}{{ '\\n' }}{% endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.raises(FtcoreError, match="cannot be split into turns"):
        _renderer_with(tok, tmpl).doc(REC)


def test_template_without_generation_prompt_is_refused(tok):
    tmpl = "{%- for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
    with pytest.raises(FtcoreError, match="add_generation_prompt"):
        _renderer_with(tok, tmpl).doc(REC)


def test_template_errors_are_bad_records(tok):
    tmpl = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(BadRecord, match="roles must alternate"):
        _renderer_with(tok, tmpl).doc(REC)


def test_no_chat_template_on_tokenizer(tok):
    t = AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()))
    t.chat_template = None
    with pytest.raises(FtcoreError, match="data.chat_template"):
        Renderer(t, "instruction", None)
    with pytest.raises(FtcoreError, match="data.chat_template"):
        Renderer(t, "instruction", "/no/such/template.jinja")


def test_template_from_file(tok, tmp_path):
    p = tmp_path / "t.jinja"
    p.write_text(CHATML_TEMPLATE)
    doc = Renderer(tok, "instruction", str(p)).doc({"instruction": "x", "output": "y"})
    assert tok.decode(doc.ids[doc.targets]) == "y<|im_end|>"
    assert np.count_nonzero(doc.targets) == len(tok.encode("y<|im_end|>", add_special_tokens=False))


def test_prompt_for_accuracy(tok):
    """The prompt is the conversation up to the last assistant turn plus its generation prompt."""
    from ftcore.config.schema import compose
    from ftcore.data.prompts import load_prompts

    r = Renderer(tok, "instruction", None)
    ids, answer = r.prompt({"instruction": "What is 2 + 2?", "output": "4"})
    assert answer == "4"
    assert tok.decode(ids) == (f"{BOS}{SH}user{EH}\n\nWhat is 2 + 2?{EOT}{SH}assistant{EH}\n\n")
    doc = r.doc({"instruction": "What is 2 + 2?", "output": "4"})
    assert doc.ids[: len(ids)].tolist() == ids and not doc.targets[: len(ids)].any()
    prompts = load_prompts(compose([]), tok)  # the bundled validation split
    assert len(prompts) == 300 and all(a for _, a in prompts)
