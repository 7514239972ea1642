"""Regenerate the bundled preference sample: the sample tasks with a right and a wrong answer.

    python -m ftcore.assets.make_preference [--seed 1] [--train 400] [--val 60]

Writes ftcore/assets/data/preference_train.jsonl and preference_val.jsonl in TRL's standard
preference shape (`{"prompt", "chosen", "rejected"}` strings, data.format=preference). The tasks
are make_data.py's; `chosen` is the right answer and `rejected` a wrong one made by a fixed rule
per task (a number off by a few, a word left unreversed or mis-reversed, the text left lowercase,
the words left unsorted): a preference the tiny base can learn, since it knows the domain's
facts (make_tiny_base.py), so `+exp=tiny_dpo`'s rewards/accuracies rise. Deterministic from the
seed; no validation prompt appears in train.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from ftcore.assets.make_data import generate, write_jsonl


def _wrong(rng: random.Random, rec: dict) -> str:
    """A wrong answer to an instruction record, by the rule of its task."""
    out, inp, ins = rec["output"], rec.get("input", ""), rec["instruction"]
    if out.lstrip("-").isdigit():
        return str(int(out) + rng.choice([-3, -2, -1, 1, 2, 3, 10]))
    if ins.startswith("Reverse"):  # the word as given (a palindrome: one letter more)
        return inp if inp != out else inp + inp[-1]
    if ins.startswith("Convert"):
        return inp if inp != out else inp.capitalize() + "!"
    if ins.startswith("Sort"):
        words = out.split()
        return " ".join(reversed(words)) if inp == out else inp
    return out + " " + out


def preference_records(seed: int, n_train: int, n_val: int) -> tuple[list[dict], list[dict]]:
    """(train, val) preference records whose wrong answer differs from the right one."""
    out, rng = [], random.Random(seed + 1)
    for rec in generate(seed, n_train + n_val, 0)[0]:
        prompt = rec["instruction"] + (f"\n{rec['input']}" if rec.get("input") else "") + "\n"
        wrong = _wrong(rng, rec)
        if wrong != rec["output"]:
            out.append({"prompt": prompt, "chosen": rec["output"], "rejected": wrong})
    return out[n_val:], out[:n_val]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--train", type=int, default=400)
    ap.add_argument("--val", type=int, default=60)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    args = ap.parse_args(argv)
    train, val = preference_records(args.seed, args.train, args.val)
    write_jsonl(args.out / "preference_train.jsonl", train)
    write_jsonl(args.out / "preference_val.jsonl", val)
    print(f"wrote {len(train)} train and {len(val)} val pairs to {args.out}")


if __name__ == "__main__":
    main()
