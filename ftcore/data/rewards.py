"""objective.rewards: the reward functions of objective=grpo (docs/grpo.md), TRL's way.

Each is called as TRL 1.16's GRPOTrainer calls a reward function:
`f(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]`, one value
per completion; `completions` are the decoded texts (special tokens skipped), or for
conversational prompts `[{"role": "assistant", "content": text}]`; each column of the prompt
record is a list with its value repeated for every completion of that prompt. None is a
completion the function does not score (NaN: TRL's `nanmean`s skip it). The weighted sum of the
functions is the reward.

Built-in, verifiable rewards (1.0 or 0.0):
- `exact_answer`: the completion, stripped, is the record's `column` (default "answer").
- `last_number`: the last number in the completion equals the `column`'s value.
- `regex`: the whole completion, stripped, matches `pattern` (a format check).
Anything else is `module:function`, the user's own function, imported when the run starts (and
by the configuration check before it): the one place where ftcore runs code it did not ship.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass

from ftcore.errors import FtcoreError

BUILTIN = ("exact_answer", "last_number", "regex")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def text_of(completion) -> str:
    """A completion as text: the string, or a conversational completion's content."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def number(text: str) -> float | None:
    """The last number written in `text` (commas between digits allowed), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _answer_number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return number(str(value)) if value is not None else None


def exact_answer(column: str) -> Callable:
    def exact_answer(completions, **columns) -> list[float]:
        answers = columns[column]
        return [float(text_of(c).strip() == str(a).strip()) for c, a in zip(completions, answers)]

    return exact_answer


def last_number(column: str) -> Callable:
    def last_number(completions, **columns) -> list[float]:
        out = []
        for c, a in zip(completions, columns[column]):
            got, want = number(text_of(c)), _answer_number(a)
            out.append(float(got is not None and want is not None and math.isclose(got, want)))
        return out

    return last_number


def regex(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def regex(completions, **_) -> list[float]:
        return [float(compiled.fullmatch(text_of(c).strip()) is not None) for c in completions]

    return regex


@dataclass(frozen=True)
class Reward:
    name: str  # rewards/NAME/mean
    fn: Callable
    weight: float


def _user_function(spec: str, where: str) -> Callable:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise FtcoreError(
            f"{spec!r} is neither a built-in reward ({', '.join(BUILTIN)}) nor module:function",
            field=where, fix="fn: last_number, or fn: my_rewards:correct (a module on the path)",
        )  # fmt: skip
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # the user's module: any error importing it is theirs to fix
        raise FtcoreError(f"cannot import {module!r}: {type(e).__name__}: {e}", field=where,
                          fix="put the module on PYTHONPATH (or in the directory you run from)") from e  # fmt: skip
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise FtcoreError(f"{module} has no function {attr!r}", field=where,
                          fix="name a function f(prompts, completions, **columns) -> list[float]")  # fmt: skip
    return fn


def build(cfg) -> list[Reward]:
    """The run's reward functions, weights and metric names; user functions are imported here."""
    specs = list(cfg.objective.rewards or [])
    if not specs:
        raise FtcoreError("objective=grpo has no reward function", field="objective.rewards",
                          fix="objective.rewards=[{fn: last_number, column: answer}] (docs/grpo.md)")  # fmt: skip
    out: list[Reward] = []
    for i, r in enumerate(specs):
        where = f"objective.rewards[{i}]"
        if r.fn in ("exact_answer", "last_number"):
            fn = (exact_answer if r.fn == "exact_answer" else last_number)(r.column or "answer")
        elif r.fn == "regex":
            if not r.pattern:
                raise FtcoreError("the regex reward needs a pattern", field=f"{where}.pattern",
                                  fix=r"pattern: '-?\d+' (what the whole completion must match)")  # fmt: skip
            try:
                fn = regex(r.pattern)
            except re.error as e:
                raise FtcoreError(f"{r.pattern!r} is not a regular expression: {e}",
                                  field=f"{where}.pattern", fix="a Python `re` pattern") from e  # fmt: skip
        else:
            fn = _user_function(r.fn, f"{where}.fn")
        name = r.name or getattr(fn, "__name__", r.fn)
        if any(name == o.name for o in out):
            raise FtcoreError(f"two rewards are named {name!r}", field=f"{where}.name",
                              fix="give each its own name: (name: ...)")  # fmt: skip
        out.append(Reward(name, fn, float(r.weight)))
    return out


def columns_needed(cfg) -> tuple[str, ...]:
    """The record columns the built-in rewards read (every record must have them)."""
    return tuple(sorted({r.column or "answer" for r in cfg.objective.rewards or []
                         if r.fn in ("exact_answer", "last_number")}))  # fmt: skip


def score(rewards: list[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list]) -> list[list[float]]:  # fmt: skip
    """[completion][function] rewards, NaN where a function returned None."""
    n = len(completions)
    table = [[math.nan] * len(rewards) for _ in range(n)]
    for j, r in enumerate(rewards):
        got = r.fn(
            prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
        )
        got = list(got)
        if len(got) != n:
            raise FtcoreError(f"the reward {r.name!r} returned {len(got)} values for {n} completions",
                              field="objective.rewards", fix="return one value per completion")  # fmt: skip
        for i, v in enumerate(got):
            if v is None:
                continue
            if not isinstance(v, numbers.Real):  # bools and numpy scalars too, as TRL takes them
                raise FtcoreError(f"the reward {r.name!r} returned {v!r}, not a number",
                                  field="objective.rewards", fix="return floats (or None)")  # fmt: skip
            table[i][j] = float(v)
    return table
