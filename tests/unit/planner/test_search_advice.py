"""The planner's advice can be followed as printed (issue 52, item 7): the search frees the
config's layout, so the "fewest GPUs that fit" it prints is searchable at that count, and a search
that finds nothing searches again at the fewest GPUs that fit; each printed row's overrides plan
a layout that fits. Run in-process through ftcore.plan's task, as `python -m ftcore.plan` runs it."""

from __future__ import annotations

import json

import pytest

from ftcore import plan as plan_cli
from ftcore.config.schema import compose
from ftcore.errors import FtcoreError


def run(capsys, *ov: str) -> dict:
    assert plan_cli.task(compose([*ov, "plan.format=json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_the_fewest_gpus_printed_are_searchable_and_its_rows_fit(capsys):
    exp = "+exp=qwen3_235b_a22b_lora"
    n = run(capsys, exp)["gpus_needed"]
    assert n == 8  # tp*pp*cp = 16 in the preset: 8 does not divide by it
    with pytest.raises(FtcoreError, match="do not divide"):
        plan_cli.task(compose([exp, f"cluster.num_gpus={n}"]))  # no search: the layout is fixed
    out = run(capsys, exp, f"cluster.num_gpus={n}", "plan.search=true")
    assert out["search"] and out["search_num_gpus"] == n and out["num_gpus"] == n
    top = out["search"][0]
    assert out["layout"]["pp"] == top["pp"] and out["fits"]  # the plan shown is the top row's
    assert "cannot run on 8 GPUs" in out["notes"][0] and top["overrides"] in out["notes"][0]
    followed = run(capsys, exp, f"cluster.num_gpus={n}", *top["overrides"].split())
    assert followed["fits"] and followed["tokens_per_s_per_gpu"] == pytest.approx(
        top["tokens_per_s_per_gpu"]
    )


def test_a_search_that_finds_nothing_searches_at_the_fewest_that_fit(capsys):
    ov = ["+exp=405b_lora", "cluster=h100"]
    out = run(capsys, *ov, "plan.search=true")
    assert out["search"] == [] and out["gpus_needed"] == 16
    fewest = out["search_at_fewest"]
    assert fewest["num_gpus"] == 16 and fewest["rows"]
    row = fewest["rows"][0]
    assert run(capsys, *ov, "cluster.num_gpus=16", *row["overrides"].split())["fits"]
