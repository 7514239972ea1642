"""training/overlap.py's manual GC: the collector is off for the run and collects at the chosen
step boundaries only; it is back on afterwards."""

from __future__ import annotations

import gc

from ftcore.config.schema import compose
from ftcore.training.overlap import Collector


def test_manual_gc_collects_every_interval_and_restores_the_collector():
    assert gc.isenabled()
    cfg = compose(["+exp=tiny_full", "perf.manual_gc=true", "perf.manual_gc_interval=3"])
    with Collector(cfg) as c:
        assert not gc.isenabled()
        assert c.collections == 1  # one at the start
        for step in range(1, 10):
            c.step(step)
        assert c.collections == 1 + 3  # steps 3, 6, 9
    assert gc.isenabled()


def test_manual_gc_off_leaves_python_alone():
    with Collector(compose(["+exp=tiny_full"])) as c:
        assert gc.isenabled()
        c.step(100)
        assert c.collections == 0
    assert gc.isenabled()
