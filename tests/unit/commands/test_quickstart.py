"""Issue 31, getting started, from the command line as a user types it: prompts from a file or
standard input (text Hydra's parser rejects), standard output holding the answer alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.cli import QUESTION, cli, error_line  # noqa: F401

ROOT = Path(__file__).resolve().parents[3]


def test_prompt_from_file_or_stdin_and_stdout_is_the_answer_alone(base_answer, tmp_path):
    """The same prompt given inline, from standard input and from a file gives the same answer;
    standard output is that answer alone (the logs are on standard error); a prompt with a comma
    and an apostrophe, which Hydra's parser rejects inline, works from a file; standard input is
    not read unless asked (an open, silent stdin does not block generate.prompt=...: the
    base_answer run, inline, has one); generate writes nothing where it runs."""
    common = ["+exp=tiny_lora", QUESTION[1], f"run.dir={tmp_path / 'run'}"]
    inline, cwd = base_answer
    prompt = QUESTION[0].split("=", 1)[1]
    piped = cli("generate", "generate.prompt_file=-", *common, input=prompt + "\n")
    for p in (inline, piped):
        assert p.returncode == 0, p.stderr[-3000:]
    assert piped.stdout == inline.stdout
    answer = inline.stdout
    assert answer.endswith("\n") and answer.count("\n") == 1 and answer.strip(), answer
    assert "loaded model.init_path weights" in inline.stderr  # the logs went to stderr
    # generate trains nothing and reads no data: neither a data.format detection nor a
    # trainable-parameter count; it says which chat template it applied (issue 52, item 10)
    assert "data.format=auto" not in inline.stderr and "trainable params" not in inline.stderr
    assert "chat template: the tokenizer's own" in inline.stderr, inline.stderr[-3000:]
    assert not any(cwd.iterdir())  # no run directory, no outputs/

    hard = "What's the capital of Peru, then? Say it = plainly."
    rejected = cli("generate", f"generate.prompt={hard}", *common)
    line = error_line(rejected)  # why prompt_file exists: Hydra cannot parse it inline; it says so
    assert line.startswith("ftcore error: generate.prompt: ") and "generate.prompt_file=" in line, (
        line
    )
    f = tmp_path / "prompt.txt"
    f.write_text(hard + "\n")
    from_file = cli("generate", f"generate.prompt_file={f}", *common)
    assert from_file.returncode == 0, from_file.stderr[-3000:]
    assert from_file.stdout.count("\n") == 1 and "ftcore" not in from_file.stdout


def test_prompt_file_errors_exit_2_before_anything_is_built(tmp_path):
    both = cli("generate", "+exp=tiny_lora", "generate.prompt=hi", "generate.prompt_file=-")
    assert "generate.prompt_file" in error_line(both) and "both" in error_line(both)
    missing = cli("generate", "+exp=tiny_lora", f"generate.prompt_file={tmp_path / 'no.txt'}")
    line = error_line(missing)
    assert "generate.prompt_file" in line and "no.txt" in line
    empty = cli("generate", "+exp=tiny_lora", "generate.prompt_file=-", input="  \n")
    assert "no prompt given" in error_line(empty)
    for p in (both, missing, empty):
        assert "loaded model" not in p.stderr and p.stdout == ""


# ---- train.epochs ------------------------------------------------------------------------------


def own_jsonl(path: Path, n: int) -> Path:
    """A user's own instruction data: n records."""
    import json

    recs = [{"instruction": f"What is {i} + {i}?", "output": str(2 * i)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_epochs_set_the_step_count_and_many_repeats_are_warned(tmp_path):
    """train.epochs=E on 10 rows with global batch 4: ceil(E * 10 / 4) steps, the last one taking
    only the rows left (so 3.5 passes, not the 3.6 that 9 full steps would make); above 3 passes
    over the data, a warning says so."""
    import math
    import re

    data = own_jsonl(tmp_path / "mine.jsonl", 10)
    p = cli("train", "+exp=tiny_lora", f"data.path={data}", "data.val_fraction=0", "data.packing=false",
            "train.epochs=3.5", "train.global_batch_size=4", "train.micro_batch_size=2",
            "eval.interval=0", "eval.accuracy=false", f"run.dir={tmp_path / 'run'}")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    rows = int(re.search(r"data \(train\): \d+ samples, .*?(\d+) rows", p.stderr).group(1))
    assert rows == 10, p.stderr[-3000:]
    steps = math.ceil(3.5 * rows / 4)
    assert f"training {steps} steps" in p.stderr, p.stderr[-3000:]
    assert "the last step takes the 3 rows left" in p.stderr, p.stderr[-3000:]
    assert "repeats its training data 3.5 times" in p.stderr, p.stderr[-3000:]


def test_epochs_and_max_steps_together_are_refused(tmp_path):
    both = cli("train", "+exp=tiny_lora", "train.epochs=2", "train.max_steps=5")
    line = error_line(both)
    assert "train.epochs" in line and "train.max_steps" in line
    assert "train.epochs" in error_line(cli("train", "+exp=tiny_lora", "train.epochs=0"))


# ---- the quick start itself (own JSONL -> adapter -> generate -> PEFT): test_docs_commands.py ----


def test_the_documented_quoting_keeps_commas_and_apostrophes():
    """docs/quickstart.md's shell + Hydra quoting for an inline prompt, as bash passes it."""
    cmd = f"""{sys.executable} -m ftcore.generate 'generate.prompt="What'"'"'s 2, plus 3?"' --cfg job"""
    p = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "prompt: What's 2, plus 3?" in p.stdout
