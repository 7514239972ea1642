"""data.format=prompt: prompt ids as TRL's GRPOTrainer makes them (standard: the tokenizer with its
special tokens; conversational: the chat template with the generation prompt), the other columns
kept, bad records and over-long prompts counted, and the prompt order a seeded stream that resumes
where it stopped."""

from __future__ import annotations

import json

import pytest

from ftcore.config.schema import compose
from ftcore.data.prompt_set import PromptLoader, load_prompts
from ftcore.data.tokenizer import load_tokenizer
from ftcore.errors import FtcoreError

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
]


def _cfg(path, *over: str):
    return compose(["+exp=tiny_grpo", f"data.path={path}", *over])


def test_prompt_ids_are_trls_and_columns_are_kept(tmp_path):
    path = tmp_path / "p.jsonl"
    recs = [{"prompt": "What is 2 + 3?", "answer": "5", "level": 1},
            {"prompt": MESSAGES, "answer": "5"}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = _cfg(path)
    tok = load_tokenizer(cfg)
    got = load_prompts(cfg, tok, str(path), ("answer",)).prompts
    assert got[0].ids == tok("What is 2 + 3?")["input_ids"]  # TRL: processing_class(text=...)
    want = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True,
                                   add_generation_prompt=True)["input_ids"]  # fmt: skip
    assert got[1].ids == list(want)
    assert got[0].columns == {"answer": "5", "level": 1} and got[1].prompt == MESSAGES


def test_bad_and_long_prompts_are_refused_or_counted(tmp_path):
    path = tmp_path / "p.jsonl"
    recs = [{"prompt": "fine", "answer": "1"}, {"question": "no prompt"}, {"prompt": ""},
            {"prompt": "fine too"}, {"prompt": "long " * 200, "answer": "2"}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = _cfg(path)
    tok = load_tokenizer(cfg)
    with pytest.raises(FtcoreError) as e:
        load_prompts(cfg, tok, str(path), ("answer",))
    assert f"{path}:2" in str(e.value) and e.value.field == "data.path"
    cfg = _cfg(path, "data.on_bad_record=skip")
    out = load_prompts(cfg, tok, str(path), ("answer",))
    assert len(out.prompts) == 1 and out.bad_records == 3 and out.dropped == 1


def test_the_stream_is_seeded_and_resumes(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(10))
    )
    cfg = _cfg(path, "train.global_batch_size=32", "objective.num_generations=8")
    prompts = load_prompts(cfg, load_tokenizer(cfg), str(path))
    a, b = PromptLoader(cfg, prompts), PromptLoader(cfg, prompts)
    first = [a.next_prompts() for _ in range(2)]
    assert [len(x) for x in first] == [4, 4] and len(set(first[0] + first[1])) == 8
    b.load_state_dict(a.state_dict())
    assert a.next_prompts() == b.next_prompts()
    assert first[0] == PromptLoader(cfg, prompts).next_prompts()
