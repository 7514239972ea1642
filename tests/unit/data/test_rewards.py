"""objective.rewards: the built-in verifiable rewards on strings and on conversational completions,
a user's module:function called with TRL's arguments, weights and names, None as not scored, and a
function that returns the wrong thing refused with its name."""

from __future__ import annotations

import math

import pytest

from ftcore.config.schema import compose
from ftcore.data import rewards
from ftcore.errors import FtcoreError


def _build(*specs: str):
    return rewards.build(compose(["+exp=tiny_grpo", f"objective.rewards=[{', '.join(specs)}]"]))


def test_builtins_score_strings_and_messages():
    exact, last, fmt = _build("{fn: exact_answer, column: ans}", "{fn: last_number}",
                              r"{fn: regex, pattern: '-?\d+', weight: 0.5}")  # fmt: skip
    comps = ["42", " 42\n", "It is 4, no 41.", "1,234", [{"role": "assistant", "content": "-3"}]]
    cols = {"ans": ["42", "42", "41", "1234", "-3"], "answer": [42, "42", 41, "1234", "-3.0"]}
    got = rewards.score([exact, last, fmt], ["p"] * 5, comps, [[1]] * 5, cols)
    assert [r[0] for r in got] == [1.0, 1.0, 0.0, 0.0, 1.0]  # exact: stripped text == column
    assert [r[1] for r in got] == [1.0, 1.0, 1.0, 1.0, 1.0]  # the last number, commas read
    assert [r[2] for r in got] == [1.0, 1.0, 0.0, 0.0, 1.0]  # the whole completion one number
    assert (exact.name, last.name, fmt.name, fmt.weight) == (
        "exact_answer",
        "last_number",
        "regex",
        0.5,
    )
    assert rewards.columns_needed(compose(["+exp=tiny_grpo"])) == ("answer",)


def test_a_users_function_gets_trls_arguments_and_none_is_unscored():
    (picky,) = _build("{fn: 'tests.support.grpo_rewards:picky_reward', name: mine}")
    got = rewards.score([picky], ["a", "b"], ["x", "y"], [[10, 1], [7]], {"answer": ["1", "1"]})
    assert picky.name == "mine"
    assert math.isnan(got[0][0]) and got[1][0] == 1.0  # 10 % 5 == 0: None; 7 % 3 == 1 % 3


def test_a_function_returning_the_wrong_count_or_type_is_refused():
    (r,) = _build("{fn: last_number}")
    bad = rewards.Reward("bad", lambda completions, **_: [1.0], 1.0)
    with pytest.raises(FtcoreError, match="returned 1 values for 2 completions"):
        rewards.score([bad], ["a", "b"], ["1", "2"], [[1], [2]], {"answer": ["1", "2"]})
    word = rewards.Reward("word", lambda completions, **_: ["yes"], 1.0)
    with pytest.raises(FtcoreError, match="not a number"):
        rewards.score([word], ["a"], ["1"], [[1]], {})
    assert rewards.score([r], ["a"], ["none here"], [[1]], {"answer": ["3"]}) == [[0.0]]
