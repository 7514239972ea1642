"""A preset's optional evaluation adapts to the user's own model and data (ftcore/config/presets.py):
`+exp=tiny_lora` with the user's instruction file holds out a fraction of it; with text data its
accuracy is skipped with one logged line; only what the user set explicitly is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ftcore.config.schema import assets_dir

BASE = str(assets_dir() / "tiny_base")


def _run(module: str, *args: str):
    return subprocess.run([sys.executable, "-m", module, "+exp=tiny_lora", f"model.hf_path={BASE}", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "FTCORE_LOG_LEVEL": "INFO"})  # fmt: skip


def _user_instructions(path, n=40):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"instruction": f"What is {i} + 1?", "output": str(i + 1)}) + "\n")
    return path


def _user_text(path, n=12):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"{i} comes before {i + 1} and after {i - 1}."}) + "\n")
    return path


def test_train_on_user_data_holds_out_a_fraction(tmp_path):
    data = _user_instructions(tmp_path / "mine.jsonl")
    run_dir = tmp_path / "run"
    r = _run("ftcore.train", f"data.path={data}", "train.max_steps=2", f"run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("evaluation holds out 10% of the training data") == 1, r.stderr[-3000:]
    acc = json.loads((run_dir / "accuracy.json").read_text())
    assert (
        acc["after fine-tuning"]["total"] == 4
    )  # 10% of the user's 40 records, not the bundled set
    assert (run_dir / "hf_adapter" / "adapter_model.safetensors").is_file()


def test_eval_on_text_data_skips_the_presets_accuracy(tmp_path):
    data = _user_text(tmp_path / "text.jsonl")
    out = tmp_path / "eval.json"
    r = _run("ftcore.eval", f"data.path={data}", "data.format=text", f"eval.output={out}",
             f"run.dir={tmp_path / 'run'}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("eval.accuracy (set by the preset) skipped") == 1, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(got) == {"loss", "tokens", "ppl"} and got["tokens"] > 0


def _one_error(r, field):
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("ftcore error:")]
    assert r.returncode == 2 and len(lines) == 1 and field in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr


def test_explicit_accuracy_on_text_data_is_refused(tmp_path):
    data = _user_text(tmp_path / "text.jsonl")
    r = _run("ftcore.eval", f"data.path={data}", "data.format=text", "eval.accuracy=true")
    _one_error(r, "eval.accuracy")


def test_explicit_accuracy_without_held_out_data_is_refused(tmp_path):
    data = _user_instructions(tmp_path / "mine.jsonl")
    r = _run("ftcore.train", f"data.path={data}", "eval.accuracy=true", "data.val_fraction=0")
    _one_error(r, "eval.accuracy")


def test_held_out_prompts_are_the_validation_split(tmp_path):
    """Accuracy's prompts are the very documents data.val_fraction holds out of training."""
    from ftcore.config.schema import compose
    from ftcore.data.pipeline import held_out_split
    from ftcore.data.prompts import load_prompts
    from ftcore.data.tokenizer import load_tokenizer

    data = _user_instructions(tmp_path / "mine.jsonl")
    cfg = compose([f"data.path={data}", "data.val_fraction=0.1", f"data.cache_dir={tmp_path}"])
    got = [answer for _, answer in load_prompts(cfg, load_tokenizer(cfg))]
    train_ids, held_out = held_out_split(40, cfg)
    assert got == [str(i + 1) for i in held_out] and len(got) == 4
    assert not set(held_out) & set(train_ids)
