"""The parity matrix's table (tests/support/matrix.py): pairwise coverage, validity, determinism,
and docs/parallelism.md showing the same runs."""

from __future__ import annotations

import itertools
from pathlib import Path

from tests.support import matrix

ROOT = Path(__file__).resolve().parents[2]


def test_every_pair_of_settings_is_in_some_run():
    runs = matrix.runs()
    covered = set().union(*(matrix._pairs(r) for r in runs))
    assert matrix.feasible_pairs() <= covered
    # every pair of two factors' settings counts, except those no valid run can hold
    names = list(matrix.FACTORS)
    missing = []
    for f, g in itertools.combinations(names, 2):
        for a, b in itertools.product(matrix.FACTORS[f], matrix.FACTORS[g]):
            if tuple(sorted([(f, a), (g, b)])) not in covered:
                missing.append((f, a, g, b))
    # the only holes: three layout axes at 2 (world 8), and the distributed optimizer without a
    # data-parallel (dp x cp) group to shard over
    assert all(
        (f in matrix.LAYOUT and g in matrix.LAYOUT) or "optimizer" in (f, g)
        for f, a, g, b in missing
    ), missing
    assert len(runs) <= 12 and all(matrix.valid(r) and matrix.world(r) > 1 for r in runs)


def test_the_table_is_deterministic_and_references_drop_only_the_how():
    assert matrix.runs() == matrix.runs()
    for r in matrix.runs():
        ref = matrix.reference_command(matrix.reference_key(r))
        extra = [o for o in matrix.command(r) if o not in ref]
        assert all(o.startswith(("parallel.", "launcher.")) for o in extra), extra


def test_parallelism_page_shows_the_table():
    page = (ROOT / "docs" / "parallelism.md").read_text()
    assert matrix.table_markdown() in page
