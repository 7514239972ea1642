"""Regenerate the bundled GRPO prompt set: the sample's tasks with a number for an answer.

    python -m ftcore.assets.make_prompts [--seed 2] [--train 600]

Writes ftcore/assets/data/prompts_train.jsonl in TRL's conversational prompt-only shape
(`{"prompt": [{"role": "user", "content": ...}], "answer": "..."}`, data.format=prompt): the
user turn as the instruction sample renders it (instruction, then the input after a blank line),
and the answer as the column the built-in rewards check (objective.rewards, docs/grpo.md). The
tasks are make_data.py's counting ones (letters in a word, a letter's occurrences in a text): a
small number each, verifiable by `last_number`, and within the tiny base's reach (it knows the
words; it has never been asked), so `+exp=tiny_grpo`'s reward can rise from its first steps. Deterministic from the seed; no prompt of the validation sample.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ftcore.assets.make_data import generate, write_jsonl

HERE = Path(__file__).parent


def _held_out() -> set[tuple[str, str]]:
    out = set()
    for line in (HERE / "data" / "val.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.add((rec["instruction"], rec.get("input", "")))
    return out


def prompt_records(seed: int, n: int) -> list[dict]:
    """n prompt records with numeric answers, none a validation question."""
    held, out = _held_out(), []
    for rec in generate(seed, 8 * n, 0)[0]:
        if len(out) == n:
            break
        if not rec["instruction"].startswith("How many"):
            continue
        if (rec["instruction"], rec.get("input", "")) in held:
            continue
        user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
        out.append({"prompt": [{"role": "user", "content": user}], "answer": rec["output"]})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--train", type=int, default=600)
    ap.add_argument("--out", type=Path, default=HERE / "data")
    args = ap.parse_args(argv)
    records = prompt_records(args.seed, args.train)
    write_jsonl(args.out / "prompts_train.jsonl", records)
    print(f"wrote {len(records)} prompts to {args.out}")


if __name__ == "__main__":
    main()
