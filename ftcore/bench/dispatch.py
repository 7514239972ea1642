"""`python -m ftcore.bench +bench=NAME [overrides]`: which benchmark kind runs. The dispatcher
imports each kind (layouts.py, vs_hf.py); no kind imports it."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from ftcore.bench import report
from ftcore.bench.layouts import run_layouts
from ftcore.bench.overhead import run_host_overhead
from ftcore.bench.plan_search import run_plan_search
from ftcore.bench.runner import Bench, expand_runs, load_avg
from ftcore.bench.vs_hf import run_cpu_vs_hf
from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")


def run_bench(cfg: DictConfig, extra: list[str], command: str) -> Path:
    """Run every configuration of cfg.bench; returns the output directory."""
    kinds = {"layouts": run_layouts, "cpu_vs_hf": run_cpu_vs_hf, "host_overhead": run_host_overhead,
             "plan_search": run_plan_search}  # fmt: skip
    if cfg.bench.kind not in kinds:
        raise FtcoreError(f"unknown kind {cfg.bench.kind!r}", field="bench.kind",
                          fix="layouts, cpu_vs_hf, host_overhead or plan_search")  # fmt: skip
    if cfg.bench.kind != "host_overhead":  # its runs are its depths and sides
        expand_runs(cfg.bench)  # exit 2 on a malformed list before anything starts
    b = Bench(cfg, extra, command)
    log.info(
        "bench %s: %s -> %s (load average %s)", cfg.bench.name, cfg.bench.kind, b.out, load_avg()
    )
    kinds[cfg.bench.kind](b)
    report.write(b.out)
    if cfg.bench.publish:  # docs/bench/<name>_<hardware>_<date>.{md,png,jsonl}
        docs = Path(__file__).resolve().parents[2] / "docs" / "bench"
        for path in report.publish(b.out, docs, str(cfg.bench.publish)):
            log.info("bench %s: published %s", cfg.bench.name, path)
    return b.out


def normalise(argv: list[str]) -> list[str]:
    """`+bench=NAME` selects the group option (config.yaml already has a `bench` default)."""
    return [
        ("bench=" + a.split("=", 1)[1]) if a.startswith(("+bench=", "++bench=")) else a
        for a in argv
    ]


def _extra(argv: list[str]) -> list[str]:
    """The overrides meant for every configuration: all but the benchmark's own."""
    return [a for a in argv if not a.lstrip("+").startswith(("bench=", "bench.")) and a != "--cfg"]


def task_for(argv: list[str]):
    def task(cfg: DictConfig) -> int | None:
        if cfg.bench.name == "none":
            raise FtcoreError("no benchmark chosen", field="bench",
                              fix="python -m ftcore.bench +bench=NAME (conf/bench/NAME.yaml)")  # fmt: skip
        command = "python -m ftcore.bench " + " ".join(argv)
        out = run_bench(cfg, _extra(argv), command)
        print(f"{out / 'bench.md'}\n{(out / 'bench.md').read_text()}")
        return None

    return task
