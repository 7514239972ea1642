"""Training and generation see the same ids as transformers' `apply_chat_template`.

The oracle is `tokenizer.apply_chat_template(messages, tokenize=True)`: what a server gives the
model. For the bundled tokenizer's own template, Meta's Llama 3 Instruct template (written into a
tiny tokenizer directory here, no download), `llama3` and `chatml` by name and ChatML with its own
special tokens: the training ids of a conversation are the oracle's ids, the prompt for each
assistant turn (with the generation prompt) is the start of them, and the answer's tokens are the
targets from exactly there. A template whose generation prompt tokenizes differently alone is
refused.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from ftcore.data.templates import CHATML_TEMPLATE, Renderer
from ftcore.data.tokenizer import bundled_tokenizer_dir
from ftcore.errors import FtcoreError

# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template, verbatim.
META_LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# ChatML with transformers' {% generation %} markers around the answers (the same text as chatml).
CHATML_MARKED = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen/Qwen2.5-72B-Instruct's tokenizer_config.json chat_template, verbatim (JSON-decoded): ChatML
# with Qwen's default system prompt when the conversation has none, and tool calls.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello, how can I help?"},
        {"role": "user", "content": "add 12 and 30 "},
        {"role": "assistant", "content": " 42 "},
        {"role": "user", "content": "thanks!\n"},
        {"role": "assistant", "content": "You're welcome.\n\nBye."},
    ],
]


def _ids(enc):
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """(label, tokenizer, data.chat_template) for every template under test."""
    bundled = AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()))
    meta_dir = tmp_path_factory.mktemp("meta_llama3")
    for f in bundled_tokenizer_dir().iterdir():
        if f.is_file() and f.name != "chat_template.jinja":
            shutil.copy(f, meta_dir / f.name)
    (meta_dir / "chat_template.jinja").write_text(META_LLAMA3)
    meta = AutoTokenizer.from_pretrained(str(meta_dir))
    assert meta.chat_template == META_LLAMA3
    qwen = AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()))
    qwen.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    qwen.chat_template = CHATML_TEMPLATE
    qwen25 = AutoTokenizer.from_pretrained(
        str(bundled_tokenizer_dir())
    )  # Qwen's own special tokens
    qwen25.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    qwen25.chat_template = QWEN25
    return [
        ("bundled", bundled, None),
        ("meta-llama3", meta, None),
        ("llama3", bundled, "llama3"),
        ("chatml", bundled, "chatml"),
        ("chatml-special", qwen, None),
        ("qwen2.5", qwen25, None),
    ]


def test_training_and_prompt_ids_are_apply_chat_template(setups):
    for label, tok, name in setups:
        r = Renderer(tok, "chat", name)
        for msgs in CONVERSATIONS:
            doc = r.doc({"messages": msgs})
            ids, targets = doc.ids.tolist(), doc.targets.tolist()
            want = _ids(tok.apply_chat_template(msgs, chat_template=r.template, tokenize=True))
            assert ids == want, (
                label,
                tok.convert_ids_to_tokens(ids),
                tok.convert_ids_to_tokens(want),
            )
            answers = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
            for k in answers:
                prompt = _ids(
                    tok.apply_chat_template(
                        msgs[:k],
                        chat_template=r.template,
                        tokenize=True,
                        add_generation_prompt=True,
                    )
                )
                assert ids[: len(prompt)] == prompt, (label, k)
                assert targets[len(prompt)] and not targets[len(prompt) - 1], (label, k)
                upto = _ids(
                    tok.apply_chat_template(msgs[: k + 1], chat_template=r.template, tokenize=True)
                )
                assert ids[: len(upto)] == upto, (label, k)
                # the targets of turn k are its answer (and end-of-turn token), nothing else
                got = tok.decode(
                    [i for i, t in zip(ids[len(prompt) : len(upto)], targets[len(prompt) :]) if t]
                )
                assert got.strip().startswith(msgs[k]["content"].strip()), (label, k, got)
            # generation and accuracy prompts: the same ids as the oracle's generation prompt
            rec = {"messages": msgs}
            prompt_ids, answer = r.prompt(rec)
            assert prompt_ids == prompt and answer == msgs[-1]["content"], label


def test_generate_prompt_is_the_training_prefix(setups):
    from ftcore.inference.generation import prompt_ids

    for label, tok, name in setups:
        state = SimpleNamespace(
            tokenizer=tok, cfg=SimpleNamespace(data=SimpleNamespace(chat_template=name))
        )
        r = Renderer(tok, "instruction", name)
        ids = prompt_ids(state, "What is 2 + 3?")
        doc = r.doc({"instruction": "What is 2 + 3?", "output": "5"})
        assert doc.ids[: len(ids)].tolist() == ids and doc.targets[len(ids)], label
        user = [{"role": "user", "content": "What is 2 + 3?"}]
        want = tok.apply_chat_template(
            user, chat_template=r.template, tokenize=True, add_generation_prompt=True
        )
        assert ids == _ids(want), label
        system = [{"role": "system", "content": "Be brief."}]  # generate.system
        want = tok.apply_chat_template(
            system + user, chat_template=r.template, tokenize=True, add_generation_prompt=True
        )
        assert prompt_ids(state, "What is 2 + 3?", "Be brief.") == _ids(want), label


def test_boundary_token_across_header_and_answer(setups):
    """ChatML on a tokenizer without its special tokens: an answer starting with a newline merges
    with the header's newline into one token. The ids are still the oracle's (not those of the
    pieces tokenized apart), and the merged token is a target, as transformers' assistant mask has it."""
    _, tok, _ = setups[0]
    r = Renderer(tok, "chat", "chatml")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\n5"}]
    doc = r.doc({"messages": msgs})
    want = _ids(tok.apply_chat_template(msgs, chat_template=r.template, tokenize=True))
    assert doc.ids.tolist() == want
    assert tok.apply_chat_template(msgs, chat_template=CHATML_MARKED, tokenize=False) == r.render(
        msgs
    )
    mask = tok.apply_chat_template(
        msgs,
        chat_template=CHATML_MARKED,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )["assistant_masks"]
    assert doc.targets.astype(int).tolist() == mask


@pytest.mark.parametrize("where", ["file", "tokenizer"])
def test_generation_prompt_that_merges_with_the_answer_is_refused(setups, tmp_path, where):
    # "assistant: " ends in a space that the answer's first word absorbs (" Hi" is one token), so
    # the prompt ids at generation end in a lone space the model never saw in training.
    tmpl = (
        "{%- for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    _, bundled, _ = setups[0]
    if where == "file":
        p = tmp_path / "t.jinja"
        p.write_text(tmpl)
        tok, name = bundled, str(p)
    else:
        tok = AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()))
        tok.chat_template, name = tmpl, None
    with pytest.raises(FtcoreError, match="generation prompt tokenizes differently") as e:
        Renderer(tok, "instruction", name)
    assert e.value.field == "data.chat_template"
    # the same template without the trailing space is fine, and matches the oracle
    ok = tmpl.replace("'assistant: '", "'assistant:'").replace(
        "': ' + m['content']", "':' + m['content']"
    )
    tok.chat_template = ok
    r = Renderer(tok, "chat", None)
    msgs = CONVERSATIONS[2]
    assert r.doc({"messages": msgs}).ids.tolist() == _ids(
        tok.apply_chat_template(msgs, tokenize=True)
    )


def test_refused_template_exits_2_before_the_model_is_built(tmp_path):
    import os
    import subprocess
    import sys

    p = tmp_path / "t.jinja"
    p.write_text(
        "{%- for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    cmd = [sys.executable, "-m", "ftcore.train", "+exp=tiny_lora", f"data.chat_template={p}",
           f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    env = {**os.environ, "FTCORE_LOG_LEVEL": "INFO"}  # to see whether the model was loaded
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "ftcore error:" in r.stderr and "data.chat_template" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "loaded model.init_path" not in r.stderr  # refused before the model was built


# The assistant-turn logic of Qwen/Qwen3-32B's chat_template (its tools branches left out): an
# assistant turn after the last user query gets a <think> block, earlier ones do not, so adding a
# user turn re-renders the turns before it.
QWEN3_TURNS = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def test_qwen3_template_is_refused_not_mis_masked():
    """Its renders are not prefixes of each other: no assistant mask can be cut from them, so the
    renderer refuses it (exit 2 naming data.chat_template) rather than train on shifted targets."""
    tok = AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN3_TURNS
    with pytest.raises(FtcoreError, match="cannot be split into turns") as e:
        Renderer(tok, "chat", None)
    assert e.value.field == "data.chat_template"
    Renderer(tok, "chat", "chatml")  # the same <|im_start|> format without think blocks


# mistralai/Mistral-7B-Instruct-v0.1 and v0.2's chat_template, verbatim: no generation prompt (the
# user turn ends in [/INST], the answer follows directly), no system role.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)


def test_mistral_template_has_no_header_and_trains_on_answers_only():
    """An assistant turn without any header is split at the answer itself: the ids are the
    oracle's, the targets are each answer and its eos, the prompt ends at [/INST]. A system
    message is a bad record (the template raises), not a silent mis-mask."""
    from ftcore.data.templates import BadRecord

    tok = AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()))
    tok.chat_template = MISTRAL
    r = Renderer(tok, "chat", None)
    msgs = [m for m in CONVERSATIONS[2] if m["role"] != "system"]
    doc = r.doc({"messages": msgs})
    assert doc.ids.tolist() == _ids(tok.apply_chat_template(msgs, tokenize=True))
    got = tok.decode([i for i, t in zip(doc.ids.tolist(), doc.targets.tolist()) if t])
    answers = [m["content"] for m in msgs if m["role"] == "assistant"]
    assert got == "".join(a + tok.eos_token for a in answers)
    prompt, answer = r.prompt({"messages": msgs})
    assert answer == answers[-1] and tok.decode(prompt).endswith(" [/INST]")
    assert doc.ids.tolist()[: len(prompt)] == prompt
    with pytest.raises(BadRecord, match="the chat template failed"):
        r.doc({"messages": CONVERSATIONS[1]})
