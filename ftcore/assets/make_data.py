"""Regenerate the bundled sample data: checkable instruction/answer pairs with short exact answers.

    python -m ftcore.assets.make_data [--seed 0] [--train 4000] [--val 300]

Writes ftcore/assets/data/train.jsonl and val.jsonl (`{"instruction", "input"?, "output"}`).
Deterministic from the seed; the validation pairs never appear in train (exact-match accuracy is
computed on them later). The tokenizer is trained on text of this domain (make_tokenizer.py).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "apple banana cherry grape lemon mango melon orange peach pear plum berry "
    "cat dog bird fish horse mouse sheep tiger lion zebra eagle snake whale "
    "red blue green yellow black white purple brown pink gray "
    "house tree river stone cloud rain snow wind fire water light night day "
    "book paper pen table chair door window street city road bridge garden "
    "happy quick slow bright dark small large warm cold soft loud quiet "
    "run jump swim read write sing dance play walk talk think sleep "
    "music story world model data token train learn code test value number "
    "apron basket candle desert engine forest guitar harbor island jacket kettle ladder "
    "magnet needle ocean pencil rabbit saddle ticket umbrella valley wagon yogurt zipper "
    "anchor button carpet dragon feather hammer iron jungle kitchen lantern mirror napkin "
    "pepper quilt rocket silver tomato violin winter butter coffee honey salad bread cheese "
    "planet comet galaxy moon star sun sky storm thunder ocean lake hill mountain island "
    "doctor farmer pilot singer teacher painter driver baker sailor writer actor nurse "
    "circle square triangle number letter word sentence answer question problem puzzle "
    "friend family child mother father sister brother uncle cousin neighbor stranger "
    "morning evening summer autumn spring monday friday january october december "
    "gentle clever brave honest proud calm eager fancy jolly lucky merry noble rapid tidy"
).split()
WORDS = tuple(dict.fromkeys(WORDS))  # unique, in order
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _phrase(rng: random.Random, lo: int = 2, hi: int = 4) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _add(rng):
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return {"instruction": f"What is {a} + {b}?", "output": str(a + b)}


def _sub(rng):
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return {"instruction": f"What is {a} - {b}?", "output": str(a - b)}


def _mul(rng):
    a, b = rng.randint(0, 99), rng.randint(0, 20)
    return {"instruction": f"What is {a} * {b}?", "output": str(a * b)}


def _reverse(rng):
    w = rng.choice(WORDS)
    return {"instruction": "Reverse the letters of the word.", "input": w, "output": w[::-1]}


def _upper(rng):
    p = _phrase(rng)
    return {"instruction": "Convert the text to uppercase.", "input": p, "output": p.upper()}


def _count(rng):
    p = _phrase(rng)
    letter = rng.choice(sorted(set(p.replace(" ", ""))) if rng.random() < 0.8 else LETTERS)
    return {
        "instruction": f"How many times does the letter '{letter}' appear in the text?",
        "input": p,
        "output": str(p.count(letter)),
    }


def _sort(rng):
    words = rng.sample(WORDS, rng.randint(3, 5))
    return {
        "instruction": "Sort the words in alphabetical order.",
        "input": " ".join(words),
        "output": " ".join(sorted(words)),
    }


def _length(rng):
    w = rng.choice(WORDS)
    return {"instruction": f"How many letters are in the word '{w}'?", "output": str(len(w))}


TASKS = (_add, _sub, _mul, _reverse, _upper, _count, _sort, _length)


def generate(seed: int, n_train: int, n_val: int) -> tuple[list[dict], list[dict]]:
    """Distinct (instruction, input) pairs; the first n_val go to validation."""
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    records: list[dict] = []
    while len(records) < n_train + n_val:
        rec = rng.choice(TASKS)(rng)
        key = (rec["instruction"], rec.get("input", ""))
        if key not in seen:
            seen.add(key)
            records.append(rec)
    return records[n_val:], records[:n_val]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=4000)
    ap.add_argument("--val", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    args = ap.parse_args(argv)
    train, val = generate(args.seed, args.train, args.val)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "val.jsonl", val)
    print(f"wrote {len(train)} train and {len(val)} val records to {args.out}")


if __name__ == "__main__":
    main()
