"""The parity matrix's table (tests/support/matrix.py): every training-path switch of the schema is
a dimension, every pair of settings some valid run can hold is in a run, the seeds are in, the
references differ from their runs by layout keys only, and docs/parallelism.md shows it all."""

from __future__ import annotations

import itertools
from pathlib import Path

from ftcore.config.groups import FtcoreConfig, switch, training_path_keys
from tests.support import matrix

ROOT = Path(__file__).resolve().parents[2]


def missing_switches(factors: dict) -> list[str]:
    """The schema's training-path keys no factor of `factors` sets."""
    keys = {k for f in factors for k in matrix.setting_keys(f, factors)}
    keys |= {k for k, f in matrix.DERIVED.items() if f in factors}
    return [k for k in training_path_keys() if k not in keys]


def test_every_training_path_switch_is_a_dimension():
    """The keys come from the schema (`switch(...)` in ftcore/config/groups.py), not from here."""
    keys = training_path_keys()
    assert {"parallel.tp", "objective.ref_adapter_path", "data.packing"} <= set(keys), keys
    assert missing_switches(matrix.FACTORS) == []


def _switch_values() -> dict[str, tuple]:
    """The values validation accepts for the training-path switches that take a few names."""
    from ftcore.validation.checks import CHOICES
    from ftcore.validation.objective import OBJECTIVES

    choices = {**CHOICES, "objective.name": OBJECTIVES}
    return {k: tuple(choices[k]) for k in training_path_keys() if choices.get(k)}


def test_every_value_of_a_named_switch_is_a_setting_or_tested_elsewhere():
    """A new value of such a switch (objective=grpo) joins the table, or says where it is tested."""
    from omegaconf import OmegaConf

    from ftcore.config.schema import compose

    base = compose(list(matrix.BASE))
    seen: dict[str, set] = {}
    for settings in matrix.FACTORS.values():
        for overrides in settings.values():
            for o in overrides:
                key = next(iter(matrix.override_keys([o])))
                value = o.split("=", 1)[1]
                seen.setdefault(key, set()).add(value)
            for key in _switch_values():  # a setting that leaves the key at the base's value
                if key not in matrix.override_keys(overrides):
                    seen.setdefault(key, set()).add(str(OmegaConf.select(base, key)))
    for key, values in _switch_values().items():
        for v in values:
            assert v in seen.get(key, set()) or (key, v) in matrix.ELSEWHERE, (key, v)
    assert all(v not in seen.get(k, set()) for k, v in matrix.ELSEWHERE), "in the table already"


def test_the_switch_test_fails_when_a_dimension_is_removed():
    for factor, lost in (("rows", "data.packing"), ("optimizer", "parallel.overlap_param_gather"),
                         ("model", "model.num_experts")):  # fmt: skip
        table = {f: s for f, s in matrix.FACTORS.items() if f != factor}
        assert lost in missing_switches(table), factor


def test_a_new_switch_in_the_schema_must_join_the_table(monkeypatch):
    """A key declared with `switch` and set by no factor is reported."""
    import dataclasses

    from ftcore.config import groups

    @dataclasses.dataclass
    class Extra:
        new_kernel: bool = switch(False)

    extended = dataclasses.make_dataclass(
        "Extended",
        [("extra", Extra, dataclasses.field(default_factory=Extra))],
        bases=(FtcoreConfig,),
    )
    monkeypatch.setattr(groups, "FtcoreConfig", extended)
    assert missing_switches(matrix.FACTORS) == ["extra.new_kernel"]


def test_every_pair_of_settings_is_in_some_run():
    runs = matrix.runs()
    covered = set().union(*(matrix.pairs(r) for r in runs))
    assert matrix.feasible_pairs() <= covered
    assert all(matrix.valid(r) for r in runs)
    # no run holds a refused pair, and each refused pair is a hole of the table
    assert not any(matrix.refused(r) for r in runs)
    assert set(matrix.REFUSED) <= set(matrix.holes())
    # every hole is either refused, or a pair no run can hold for the reasons `unfit` names
    every = set(matrix._BIT)
    assert set(matrix.holes()) == every - covered
    assert len(runs) <= 24 and max(matrix.world(r) for r in runs) <= matrix.MAX_WORLD


def test_the_seeds_lead_the_table():
    runs = matrix.runs()
    for seed, run in zip(matrix.SEEDS, runs, strict=False):
        assert all(run[f] == v for f, v in seed.items()), (seed, run)


def test_the_table_is_deterministic_and_references_drop_only_the_how():
    matrix.runs.cache_clear()
    matrix._combos.cache_clear()
    assert matrix.runs() == matrix.runs()
    paths = {"moe": "MOE", "deepseek": "DEEPSEEK", "adapter": "ADAPTER"}
    for r in matrix.runs():
        ref = matrix.reference_command(matrix.reference_key(r), paths)
        extra = [o for o in matrix.command(r, paths) if o not in ref]
        assert all(o.startswith("parallel.") for o in extra), extra
        assert all(o in matrix.command(r, paths) for o in ref)


def test_factor_settings_are_distinct_and_what_precedes_how():
    assert list(matrix.FACTORS)[: len(matrix.WHAT)] == list(matrix.WHAT)
    for f, settings in matrix.FACTORS.items():
        if f != "dp":  # dp is what the world leaves: no key of its own
            assert len({tuple(s) for s in settings.values()}) == len(settings), f
    for a, b in itertools.combinations(matrix.LAYOUT, 2):
        assert matrix.setting_keys(a).isdisjoint(matrix.setting_keys(b))


def test_parallelism_page_shows_the_table():
    page = (ROOT / "docs" / "parallelism.md").read_text()
    assert matrix.table_markdown() in page
    assert matrix.refused_markdown() in page
    assert matrix.holes_markdown() in page
    for k in training_path_keys():
        assert f"`{k}`" in page, k
