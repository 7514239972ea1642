"""Regenerate the tiny pretrained base of `tiny_lora` (ftcore/assets/tiny_base/).

    python -m ftcore.assets.make_tiny_base [--steps 100] [--seed 0] [extra train overrides]

1. Writes a plain-text corpus of the sample domain (the words, numbers and string facts the
   instruction data is about: "417 + 26 = 443", "lemon backwards is nomel", ...) with none of the
   fine-tuning task itself: no instructions, no chat template, no question/answer turns, and no
   fact that answers a held-out validation question.
2. Pretrains the `tiny` model on it with `+exp=tiny_full data.format=text` (ftcore's own trainer).
3. Keeps the run's `hf_model/` (config.json, bf16 safetensors, tokenizer) as the shipped base.
So `tiny_lora` starts from a model that knows the domain but not the task: held-out exact-match
accuracy starts near zero and the LoRA fine-tune visibly raises it.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ftcore.assets.make_data import LETTERS, WORDS

HERE = Path(__file__).parent
OUT = HERE / "tiny_base"


def _phrase(rng: random.Random, lo: int = 2, hi: int = 4) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _held_out() -> set[tuple[str, str]]:
    """(instruction, input) of every validation record: facts answering them stay out."""
    out = set()
    for line in (HERE / "data" / "val.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.add((rec["instruction"], rec.get("input", "")))
    return out


def _fact(rng: random.Random) -> tuple[str, tuple[str, str]]:
    """One declarative fact and the (instruction, input) of the question it would answer."""
    kind = rng.randrange(8)
    if kind < 3:
        op = "+-*"[kind]
        a, b = (
            (rng.randint(0, 99), rng.randint(0, 20))
            if op == "*"
            else (rng.randint(0, 999), rng.randint(0, 999))
        )
        c = a + b if op == "+" else a - b if op == "-" else a * b
        return f"{a} {op} {b} = {c}", (f"What is {a} {op} {b}?", "")
    if kind == 3:
        w = rng.choice(WORDS)
        return f"{w} backwards is {w[::-1]}", ("Reverse the letters of the word.", w)
    if kind == 4:
        p = _phrase(rng)
        return f"{p} in capitals is {p.upper()}", ("Convert the text to uppercase.", p)
    if kind == 5:
        p = _phrase(rng)
        letter = rng.choice(sorted(set(p.replace(" ", ""))) if rng.random() < 0.8 else LETTERS)
        q = (f"How many times does the letter '{letter}' appear in the text?", p)
        return f"the letter {letter} appears {p.count(letter)} times in {p}", q
    if kind == 6:
        words = rng.sample(WORDS, rng.randint(3, 5))
        return f"{' '.join(words)} in alphabetical order is {' '.join(sorted(words))}", (
            "Sort the words in alphabetical order.", " ".join(words))  # fmt: skip
    w = rng.choice(WORDS)
    return f"the word {w} has {len(w)} letters", (f"How many letters are in the word '{w}'?", "")


def corpus(n_docs: int, seed: int) -> list[dict]:
    """Documents of 6-12 facts each, never one that answers a validation question."""
    rng, held = random.Random(seed), _held_out()
    docs = []
    while len(docs) < n_docs:
        facts = []
        while len(facts) < rng.randint(6, 12):
            text, question = _fact(rng)
            if question not in held:
                facts.append(text)
        docs.append({"text": ". ".join(facts) + "."})
    return docs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--work", type=Path, default=None, help="keep the corpus and run here")
    args, extra = ap.parse_known_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="tiny_base_"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "corpus.jsonl"
    with open(data, "w") as f:
        for doc in corpus(args.docs, args.seed):
            f.write(json.dumps(doc) + "\n")
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "ftcore.train", "+exp=tiny_full", f"run.dir={run_dir}", f"data.path={data}",
           "data.format=text", "data.packing=true", f"train.max_steps={args.steps}", f"optim.lr={args.lr}",
           "sched.warmup_steps=10", f"sched.min_lr={args.lr / 10}", "eval.interval=0", "export.dtype=bf16",
           "checkpoint.interval=0", "checkpoint.save_at_end=false", f"run.seed={args.seed}", *extra]  # fmt: skip
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    for f in (run_dir / "hf_model").iterdir():
        if f.suffix in (".json", ".safetensors", ".jinja"):
            shutil.copy2(f, args.out / f.name)
    losses = [
        json.loads(x)["loss"]
        for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in x
    ]
    print(
        f"pretrained {args.steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
