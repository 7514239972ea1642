"""The bundled tokenizer: loadable by transformers, exactly the model's vocab, Llama 3 specials and
chat template, regenerated bit for bit by its script; load_tokenizer's choice and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ftcore.config.schema import compose
from ftcore.data.tokenizer import bundled_tokenizer_dir, load_tokenizer
from ftcore.errors import FtcoreError

SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir()))


def test_vocab_matches_tiny_model(tok):
    cfg = compose(["model=tiny"])
    assert len(tok) == cfg.model.vocab_size == 2048
    assert max(tok.get_vocab().values()) == 2047


def test_llama3_specials_and_chat_template(tok):
    for s in SPECIALS:
        ids = tok.encode(s, add_special_tokens=False)
        assert len(ids) == 1, s
    assert tok.bos_token == "<|begin_of_text|>"
    assert tok.eos_token == "<|eot_id|>"
    assert tok.pad_token == "<|finetune_right_pad_id|>"
    msgs = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>"
    )
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_round_trip_and_digits(tok):
    text = "Reverse the letters of the word.\n\nbanana 123"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode("405", add_special_tokens=False)) == ["4", "0", "5"]
    assert tok.encode("hi")[0] == tok.bos_token_id  # plain encoding starts with bos, like Llama 3


def test_regenerates_identically(tmp_path: Path):
    from ftcore.assets import make_tokenizer

    make_tokenizer.main(["--out", str(tmp_path)])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (bundled_tokenizer_dir() / name).read_bytes(), name


def test_sample_data_regenerates_identically(tmp_path: Path):
    from ftcore.assets import make_data
    from ftcore.config.schema import assets_dir

    make_data.main(["--out", str(tmp_path)])
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_bytes() == (assets_dir() / "data" / name).read_bytes(), name


def test_load_tokenizer_choices(tmp_path: Path):
    cfg = compose([])
    assert len(load_tokenizer(cfg)) == 2048  # bundled by default
    cfg = compose([f"model.tokenizer={tmp_path / 'nope'}"])
    with pytest.raises(FtcoreError, match="model.tokenizer"):
        load_tokenizer(cfg)
    cfg = compose([f"model.hf_path={tmp_path}"])  # exists, holds no tokenizer
    with pytest.raises(FtcoreError, match="model.hf_path"):
        load_tokenizer(cfg)
    AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir())).save_pretrained(tmp_path / "tk")
    cfg = compose([f"model.hf_path={tmp_path / 'nope'}", f"model.tokenizer={tmp_path / 'tk'}"])
    assert len(load_tokenizer(cfg)) == 2048  # model.tokenizer wins over model.hf_path


def test_bundled_loads_as_autotokenizer_does(tok, tmp_path: Path):
    """from_directory builds the bundled tokenizer as its config's class without AutoTokenizer's
    index of transformers' model packages: the same tokenizer AutoTokenizer gives (the oracle);
    any other directory still goes through AutoTokenizer."""
    from ftcore.data.tokenizer import from_directory

    mine = from_directory(bundled_tokenizer_dir())
    assert type(mine) is type(tok) and mine.init_kwargs == tok.init_kwargs
    assert mine.get_vocab() == tok.get_vocab() and mine.special_tokens_map == tok.special_tokens_map
    assert mine.chat_template == tok.chat_template and mine.pad_token_id == tok.pad_token_id
    msgs = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    assert mine.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
    for text in ("Reverse the letters.\n\nbanana 123", " héllo <|eot_id|>  x", ""):
        assert mine(text)["input_ids"] == tok(text)["input_ids"], text
    tok.save_pretrained(tmp_path / "tk")
    config = tmp_path / "tk" / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<|eot_id|>", "<|end_of_text|>"))
    assert from_directory(tmp_path / "tk").eos_token == "<|end_of_text|>"  # read, not assumed


def test_a_tokenizer_is_a_local_directory_and_never_runs_its_code(tmp_path: Path):
    """Issue 46: a Hub name is refused (never downloaded); a directory whose tokenizer_config.json
    maps AutoTokenizer to its own module does not import it (trust_remote_code=False)."""
    import shutil

    from ftcore.data.tokenizer import bundled_tokenizer_dir, from_directory

    with pytest.raises(FtcoreError, match="meta-llama/Llama-3.1-8B is not a local directory"):
        from_directory("meta-llama/Llama-3.1-8B")
    d = tmp_path / "tok"
    shutil.copytree(bundled_tokenizer_dir(), d)
    marker = tmp_path / "code_ran"
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    conf = json.loads((d / "tokenizer_config.json").read_text())
    conf["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    try:
        from_directory(d)
    except Exception:  # noqa: BLE001 - refusing is fine too; running the code is not
        pass
    assert not marker.exists()
