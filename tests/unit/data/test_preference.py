"""data.format=preference: the token ids and completion masks TRL 1.16's DPOTrainer gives, for
standard and conversational records and under truncation; pairs kept whole through micro-batches,
DP shards, packing, CP and epochs; bad records refused (exit 2) or counted."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ftcore.config.schema import compose
from ftcore.data import cp, formats
from ftcore.data.pipeline import build_train_loader, build_val_batches, set_steps_from_epochs
from ftcore.data.tokenizer import load_tokenizer
from ftcore.errors import FtcoreError
from ftcore.validation import checks

CHAT = Path(__file__).parents[2] / "data" / "preference_chat.jsonl"
STANDARD = [
    {"prompt": "What is 2 + 3?\n", "chosen": "5", "rejected": "6"},
    {"prompt": "Say hi", "chosen": "hi<|eot_id|>", "rejected": "hello there"},  # BPE merge
    {"prompt": "", "chosen": "lemon", "rejected": "nomel nomel"},
    {
        "prompt": "Reverse the letters of the word.\nplanet\n",
        "chosen": "tenalp " * 14,
        "rejected": "x",
    },
    {
        "prompt": "Sort the words. " + "zebra apple " * 20,
        "chosen": "a",
        "rejected": "b",
    },  # too long
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(compose([]))


def write(path: Path, records: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def cfg_for(tmp: Path, data: str, *extra: str):
    return compose(["objective=dpo", f"data.cache_dir={tmp}/cache", f"data.path={data}", "data.format=preference",
                    "data.seq_len=40", "train.global_batch_size=4", "train.micro_batch_size=2",
                    *extra])  # fmt: skip


def trl_batch(tok, records: list, max_length: int | None):
    """TRL's own preprocessing (DPOTrainer._prepare_dataset: EOS, tokenization, the prompt-fills
    filter) and collator (truncation), on the records: the oracle."""
    from datasets import Dataset
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    args = SimpleNamespace(
        dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start"
    )
    trainer = SimpleNamespace(_tokenizer=tok)  # the one attribute _prepare_dataset reads
    ds = DPOTrainer._prepare_dataset(trainer, Dataset.from_list(records), tok, args, "eval")
    examples = [{k: ex[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for ex in ds]
    collate = DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=max_length)
    return collate(examples), len(examples)


def ours(cfg, tok, path: str):
    """(tokens, loss mask) per sequence, chosen then rejected of each pair in record order, from
    the evaluation loader (fixed order), with the pair tags checked against the loss mask."""
    seqs = {0: [], 1: []}
    for batch in build_val_batches(cfg, tok, 0, 1, path=path):
        for mb in batch:
            assert torch.equal(mb.pair_index >= 0, mb.loss_mask > 0)
            for r in range(mb.tokens.shape[0]):
                n = int((mb.segment_ids[r] > 0).sum())
                if n:
                    assert mb.pair_index[r][mb.loss_mask[r] > 0].unique().tolist() == [r // 2]
                    seqs[r % 2].append((mb.tokens[r, :n].tolist(), mb.loss_mask[r, : n - 1]))
                    assert (mb.pair_side[r][mb.loss_mask[r] > 0] == r % 2).all()
    return seqs[0] + seqs[1]  # TRL's order: every chosen, then every rejected


@pytest.mark.parametrize("shape", ["standard", "conversational"])
def test_ids_and_masks_are_trls(tmp_path, tok, shape):
    records = (
        STANDARD
        if shape == "standard"
        else [json.loads(x) for x in CHAT.read_text().split("\n") if x]
    )
    path = write(tmp_path / "p.jsonl", records)
    seq_len = 40 if shape == "standard" else 256
    cfg = cfg_for(tmp_path, path, f"data.seq_len={seq_len}", "data.trim_padding=false")
    want, kept = trl_batch(tok, records, seq_len)
    got = ours(cfg, tok, path)
    assert len(got) == 2 * kept
    if shape == "standard":
        assert kept == len(records) - 1  # the prompt that fills seq_len: dropped, as TRL filters it
        assert any(len(ids) == seq_len for ids, _ in got)  # and one sequence truncated
    for i, (ids, mask) in enumerate(got):
        n = int(want["attention_mask"][i].sum())
        assert ids == want["input_ids"][i, :n].tolist()
        # our mask at t marks the target ids[t + 1]; TRL's marks the token itself
        assert mask.tolist() == want["completion_mask"][i, 1:n].float().tolist()


def pairs_of(mb) -> dict[int, set[int]]:
    """pair -> the sides with targets, from the micro-batch's tags."""
    out: dict[int, set[int]] = {}
    for p, s in zip(
        mb.pair_index[mb.loss_mask > 0].tolist(), mb.pair_side[mb.loss_mask > 0].tolist()
    ):
        out.setdefault(p, set()).add(s)
    return out


@pytest.mark.parametrize("packing", [False, True])
def test_pairs_stay_whole_and_count_as_samples(tmp_path, tok, packing, caplog):
    records = [{"prompt": f"What is {i} + {i}?\n", "chosen": str(2 * i), "rejected": str(i) * (1 + i % 4)}
               for i in range(1, 41)]  # fmt: skip
    path = write(tmp_path / "p.jsonl", records)
    extra = [f"data.packing={packing}", "data.seq_len=64", "train.global_batch_size=8", "train.epochs=1",
             "run.seed=3"]  # fmt: skip
    loaders = [build_train_loader(cfg_for(tmp_path, path, *extra), tok, r, 2) for r in range(2)]
    rows = loaders[0].report["rows"]
    with caplog.at_level("INFO", logger="ftcore"):
        set_steps_from_epochs(loaders[0].cfg, rows, loaders[0])
    # packed, global_batch_size counts rows of whole pairs, and the log says so (issue 52, item 8)
    said = f"a step of 8 rows trains ~{round(40 / rows * 8)} pairs" in caplog.text
    assert said == packing, caplog.text
    assert loaders[0].report["samples"] == 40  # pairs, not sequences
    seen, steps = [], loaders[0].cfg.train.max_steps
    assert steps == -(-rows // 8) and (packing or rows == 40)
    for ld in loaders[1:]:
        ld.end = loaders[0].end
    for _ in range(steps):
        for ld in loaders:
            for mb in ld.next_microbatches():
                assert mb.tokens.shape[0] == (2 if packing else 4)  # micro_batch_size counts pairs
                tags = pairs_of(mb)
                assert sorted(tags) == list(range(mb.num_pairs))
                assert all(
                    sides == {0, 1} for sides in tags.values()
                )  # both sides, same micro-batch
                for r in range(mb.tokens.shape[0]):  # each sequence its own document
                    docs = mb.segment_ids[r][mb.loss_mask[r] > 0]
                    for p in tags:
                        for s in (0, 1):
                            sel = (mb.pair_index[r] == p) & (mb.pair_side[r] == s)
                            assert docs.numel() == 0 or mb.segment_ids[r][sel].unique().numel() <= 1
                seg = mb.segment_ids
                seen += [tuple(mb.tokens[r][seg[r] == k].tolist()) for k in range(1, int(seg.max()) + 1)
                         for r in range(seg.shape[0]) if (seg[r] == k).any()]  # fmt: skip
    assert len(seen) == 80 and len(set(seen)) == 80  # one epoch: every sequence of every pair once


def test_resume_position_counts_pairs(tmp_path, tok):
    records = [
        {"prompt": f"{i} + 1 =", "chosen": str(i + 1), "rejected": str(i)} for i in range(20)
    ]
    cfg = cfg_for(tmp_path, write(tmp_path / "p.jsonl", records), "train.global_batch_size=8")
    ld = build_train_loader(cfg, tok, 0, 1)
    assert ld.report["unit"] == "pairs" and ld.report["rows"] == 20
    few = build_train_loader(cfg_for(tmp_path, cfg.data.path, "data.max_samples=5"), tok, 0, 1)
    assert few.report["samples"] == 5  # data.max_samples counts pairs
    ld.next_rows(), ld.next_rows()
    state = ld.state_dict()
    assert (state["epoch"], state["index"]) == (0, 16)
    want = [ld.next_microbatches() for _ in range(2)]  # into the second epoch
    again = build_train_loader(cfg, tok, 0, 1)
    again.load_state_dict(state)
    for mbs in want:
        for a, b in zip(mbs, again.next_microbatches()):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.pair_index, b.pair_index)


@pytest.mark.parametrize("packing", [False, True])
def test_cp_slices_the_pair_tags_with_the_tokens(tmp_path, tok, packing):
    path = write(tmp_path / "p.jsonl", STANDARD[:4])
    cfg = cfg_for(tmp_path, path, f"data.packing={packing}", "parallel.cp=2", "data.seq_len=64")
    mb = build_val_batches(cfg, tok, 0, 1, path=path)[0][0]
    assert (mb.cu_seqlens_padded is not None) == packing and mb.num_pairs >= (2 if packing else 1)
    assert mb.tokens.shape[1] % 4 == 0  # trimmed to what 2*cp divides
    parts = [cp.shard(mb, 2, r) for r in range(2)]
    for name in ("pair_index", "pair_side", "loss_mask"):
        whole = getattr(mb, name).gather(1, cp.gathered_row_positions(mb, 2))
        assert torch.equal(torch.cat([getattr(p, name) for p in parts], 1), whole)


BAD = [
    ({"prompt": "q", "chosen": "a"}, 'missing field "rejected"'),
    ({"chosen": "a", "rejected": "b"}, 'missing field "prompt"'),
    ({"prompt": "q", "chosen": " ", "rejected": "b"}, '"chosen" completion is empty'),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "identical"),
    (
        {"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
        "all strings",
    ),
]


@pytest.mark.parametrize(
    "bad,message", BAD, ids=["no_rejected", "no_prompt", "empty", "same", "mixed"]
)
def test_bad_pair_exits_2_naming_file_and_line(tmp_path, tok, bad, message):
    path = write(tmp_path / "p.jsonl", [STANDARD[0], bad, STANDARD[1]])
    with pytest.raises(FtcoreError) as e:
        build_train_loader(cfg_for(tmp_path, path), tok, 0, 1)
    assert f"{path}:2: " in str(e.value) and message in str(e.value)
    assert e.value.field == "data.path" and "on_bad_record=skip" in e.value.fix


def test_bad_pairs_are_counted_with_skip(tmp_path, tok):
    path = write(tmp_path / "p.jsonl", [STANDARD[0], *[b for b, _ in BAD], STANDARD[1], "{oops"])
    ld = build_train_loader(cfg_for(tmp_path, path, "data.on_bad_record=skip"), tok, 0, 1)
    assert ld.report["bad_records"] == len(BAD) + 1 and ld.report["samples"] == 2


def test_preference_is_detected_and_checked(tmp_path, tok):
    path = write(tmp_path / "p.jsonl", STANDARD[:2])
    cfg = cfg_for(tmp_path, path, "data.format=auto")
    formats.resolve(cfg, say=False)
    assert cfg.data.format == "preference"
    for extra, field in [
        ("data.train_on_prompt=true", "data.train_on_prompt"),
        ("++objective.name=sft", "objective"),
    ]:
        with pytest.raises(FtcoreError) as e:
            build_train_loader(cfg_for(tmp_path, path, extra), tok, 0, 1)
        assert e.value.field == field
    with pytest.raises(FtcoreError, match="preference objective"):  # before anything is built
        checks.validate(cfg_for(tmp_path, path, "++objective.name=sft"), 1)
    plain = write(tmp_path / "i.jsonl", [{"instruction": "q", "output": "a"}])
    with pytest.raises(FtcoreError, match="preference pairs") as e:
        build_train_loader(cfg_for(tmp_path, plain, "data.format=instruction", "++objective.name=dpo"),
                           tok, 0, 1)  # fmt: skip
    assert e.value.field == "data.format"


def test_bundled_sample_is_the_default_and_what_its_script_writes(tmp_path, tok):
    from ftcore.assets import make_preference
    from ftcore.config.schema import assets_dir

    cfg = compose(["objective=dpo", f"data.cache_dir={tmp_path}/cache", "data.format=preference"])
    assert build_train_loader(cfg, tok, 0, 1).report["samples"] == 400
    dpo = compose(["++objective.name=dpo"])  # data.format=auto: the bundled pairs under dpo
    formats.resolve(dpo, say=False)
    assert dpo.data.format == "preference"
    assert sum(mb.num_pairs for b in build_val_batches(cfg, tok, 0, 1) for mb in b) == 60

    make_preference.main(["--out", str(tmp_path)])
    for name in ("preference_train.jsonl", "preference_val.jsonl"):
        assert (tmp_path / name).read_bytes() == (assets_dir() / "data" / name).read_bytes()
    rows = [json.loads(x) for x in (tmp_path / "preference_train.jsonl").read_text().splitlines()]
    assert len(rows) >= 300 and all(r["chosen"] != r["rejected"] for r in rows)
    assert np.mean([r["chosen"].isupper() or r["chosen"][:1].isdigit() for r in rows]) > 0.3


def test_a_dropped_pair_is_named_with_its_line_and_rule(tmp_path, tok, caplog):
    """Issue 52, item 8: each dropped pair (the first few of a source) is named by its file and
    line with the rule that dropped it; a sequence longer than the tokenizer's model_max_length
    (1024 for the bundled one) brings no "Token indices sequence length" warning from transformers:
    ftcore cuts at data.seq_len itself."""
    import logging

    long = {"prompt": "Say it. ", "chosen": "lemon " * 1100, "rejected": "x"}
    path = write(tmp_path / "p.jsonl", [*STANDARD, long])
    with caplog.at_level(logging.WARNING):
        build_train_loader(cfg_for(tmp_path, path), tok, 0, 1)
        assert (
            f"dropped the pair at {path}:5: its prompt fills data.seq_len=40: no chosen"
            in caplog.text
        )
        assert "Token indices sequence length" not in caplog.text
        caplog.clear()
        build_train_loader(cfg_for(tmp_path, path, "data.truncate=drop"), tok, 0, 1)
        assert f"dropped the pair at {path}:4: its chosen sequence has" in caplog.text
        assert "over data.seq_len=40 (data.truncate=drop)" in caplog.text
        caplog.clear()
        build_train_loader(
            cfg_for(tmp_path, path, "data.packing=true", "data.pack_multiple=1"), tok, 0, 1
        )
        assert f"dropped the pair at {path}:4: packed, its sequences of 40 + " in caplog.text
        assert "do not fit one row of data.seq_len=40" in caplog.text
