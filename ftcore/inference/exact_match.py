"""Exact-match accuracy: greedy answers to held-out instruction prompts against their reference
answers (`eval.accuracy`). The trainer scores before and after training; `ftcore.eval` once."""

from __future__ import annotations

import logging

from ftcore.errors import FtcoreError
from ftcore.inference.generation import generate_ids, stop_ids
from ftcore.runtime import safe_files

log = logging.getLogger("ftcore")


def normalise(text: str) -> str:
    return " ".join(text.strip().split())


def exact_match(state, path: str | None = None, *, max_samples: int | None = None,
                max_new_tokens: int = 32, batch: int = 64) -> dict:  # fmt: skip
    """Greedy answers to the held-out instruction prompts vs their reference answers
    (whitespace-normalised exact match). Every rank calls it. A row stops as soon as its text can
    no longer match, or 2 tokens past the longest reference: the score is the same, the work less."""
    from ftcore.data.prompts import load_prompts

    cfg, tok = state.cfg, state.tokenizer
    if cfg.data.format not in ("instruction", "chat", "prompt_completion"):
        raise FtcoreError("exact-match accuracy needs instruction or chat data", field="eval.accuracy",
                          fix="use data.format=instruction (or chat), or drop eval.accuracy")  # fmt: skip
    pairs = load_prompts(cfg, tok, path)
    if max_samples:
        pairs = pairs[:max_samples]
    if not pairs:
        raise FtcoreError("no prompts to compute accuracy on", field="data.val_path",
                          fix="data.val_path=FILE of instruction/chat records, or eval.accuracy=false")  # fmt: skip
    stop, pad = stop_ids(tok), tok.pad_token_id or 0
    correct = 0
    samples = []
    for i in range(0, len(pairs), batch):
        part = pairs[i : i + batch]
        wants = [normalise(w) for _, w in part]

        def keep(
            j, ids, wants=wants
        ):  # normalise(a + b) starts with normalise(a): a miss stays a miss
            return wants[j].startswith(normalise(tok.decode(ids, skip_special_tokens=True)))

        budget = max(len(tok(w, add_special_tokens=False)["input_ids"]) for w in wants) + 2
        answers = generate_ids(state, [p for p, _ in part], max_new_tokens=min(budget, max_new_tokens),
                               stop=stop, pad_id=pad, keep=keep)  # fmt: skip
        for (_, want), ids in zip(part, answers):
            got = tok.decode(ids, skip_special_tokens=True)
            correct += normalise(got) == normalise(want)
            if len(samples) < 3:
                samples.append({"answer": got, "expected": want})
    return {
        "accuracy": correct / len(pairs),
        "correct": correct,
        "total": len(pairs),
        "samples": samples,
    }


def accuracy(state, what: str, before: float | None = None) -> float:
    """Exact-match accuracy on the held-out data, logged on rank 0 and written to
    `<run.dir>/accuracy.json` (for `eval.accuracy=true`; the trainer calls it before and after)."""
    import json

    cfg = state.cfg
    res = exact_match(state, max_samples=cfg.eval.max_samples)
    if state.info.rank == 0:
        log.info("held-out exact-match accuracy %s: %.1f%% (%d/%d)%s; e.g. %s", what, 100 * res["accuracy"],
                 res["correct"], res["total"], "" if before is None else f" (before: {100 * before:.1f}%)",
                 "; ".join(f"{s['expected']!r} -> {s['answer']!r}" for s in res["samples"][:2]))  # fmt: skip
        f = state.run_dir / "accuracy.json"
        saved = safe_files.read_json_object(f, "run.dir", root=f.parent) if f.is_file() else {}
        saved[what] = {k: res[k] for k in ("accuracy", "correct", "total")} | {"step": state.step}
        safe_files.write_atomic(f, json.dumps(saved, indent=1) + "\n")
    return res["accuracy"]
