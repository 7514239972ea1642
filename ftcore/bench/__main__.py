"""`python -m ftcore.bench +bench=NAME [overrides]`: run a benchmark (conf/bench/NAME.yaml).

Overrides under `bench.` change the benchmark (e.g. `bench.measure_steps=10`); any other override
is added to every configuration (e.g. `cluster.num_gpus=16`). Results are appended to
outputs/bench/<name>/bench.jsonl, and bench.md / bench.png are rewritten from the latest run.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from ftcore.cli import main
from ftcore.errors import FtcoreError


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
        from ftcore.bench.dispatch import run_bench

        if cfg.bench.name == "none":
            raise FtcoreError("no benchmark chosen", field="bench",
                              fix="python -m ftcore.bench +bench=NAME (conf/bench/NAME.yaml)")  # fmt: skip
        command = "python -m ftcore.bench " + " ".join(argv)
        out = run_bench(cfg, _extra(argv), command)
        print(f"{out / 'bench.md'}\n{(out / 'bench.md').read_text()}")
        return None

    return task


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main("bench", task_for(args), normalise(args)))
