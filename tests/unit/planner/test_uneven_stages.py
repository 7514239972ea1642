"""Uneven pipeline stages in the planner (issue 53): DeepSeek-V3's 61 layers take no even split at
any pp > 1, so the search proposes uneven stages (layers.first_stage_rule), prints the keys that
select them, and pasting those keys plans the same layout; the plan's stages follow the split; a
count that does not work exits 2 naming the key. Run in-process through ftcore.plan's task, as
`python -m ftcore.plan` runs it."""

from __future__ import annotations

import json

import pytest

from ftcore import plan as plan_cli
from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.planner.layers import first_stage_rule

EXP = "+exp=deepseek_v3_lora"


def run(capsys, *ov: str) -> dict:
    assert plan_cli.task(compose([*ov, "plan.format=json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_search_proposes_uneven_stages_and_its_overrides_plan_them(capsys):
    out = run(capsys, EXP, "plan.search=true", "plan.top=20")
    piped = [r for r in out["search"] if r["pp"] > 1]
    assert piped, "61 layers: no pp > 1 layout without uneven stages"
    for r in piped:
        first = first_stage_rule(61, r["pp"], r["vp"])
        assert r["pp_first_stage_layers"] == first
        assert f"parallel.pp_first_stage_layers={first}" in r["overrides"]
    top = piped[0]
    followed = run(capsys, EXP, *top["overrides"].split())
    assert followed["fits"] and followed["tokens_per_s_per_gpu"] == pytest.approx(
        top["tokens_per_s_per_gpu"]
    )
    rest = (61 - top["pp_first_stage_layers"]) // (top["pp"] - 1)
    want = [top["pp_first_stage_layers"]] + [rest] * (top["pp"] - 1)
    assert [s["layers"] for s in followed["stages"]] == want


def test_search_clears_the_configs_own_stages(capsys):
    """A config with uneven stages, searched: a row with megatron's own split says =null."""
    own = (EXP, "parallel.pp=4", "parallel.ep=8", "parallel.pp_first_stage_layers=16")
    assert [s["layers"] for s in run(capsys, *own)["stages"]] == [16, 15, 15, 15]
    rows = run(capsys, *own, "plan.search=true", "plan.top=20")["search"]
    flat = next(r for r in rows if r["pp"] == 1)
    assert "parallel.pp_first_stage_layers=null" in flat["overrides"]
    assert run(capsys, *own, *flat["overrides"].split())["layout"]["pp"] == 1


@pytest.mark.parametrize(
    "bad,key",
    [
        (("parallel.pp_first_stage_layers=14",), "pp_first_stage_layers"),  # 47 over 3 stages
        (("parallel.pp_first_stage_layers=0",), "pp_first_stage_layers"),
        (
            ("parallel.pp_first_stage_layers=13", "parallel.pp_last_stage_layers=13"),
            "pp_first_stage_layers",
        ),  # fmt: skip
        (("parallel.pp=1", "parallel.pp_last_stage_layers=1"), "pp_last_stage_layers"),
    ],
)
def test_a_count_that_does_not_split_names_the_key(bad, key):
    with pytest.raises(FtcoreError, match=f"parallel.{key}"):
        plan_cli.task(compose([EXP, "parallel.pp=4", "parallel.ep=8", *bad]))


def test_no_split_at_pp4_suggests_the_key():
    with pytest.raises(FtcoreError, match="pp_first_stage_layers=13"):
        plan_cli.task(compose([EXP, "parallel.pp=4", "parallel.ep=8"]))
