"""`python -m ftcore.bench +bench=NAME [overrides]`: run a benchmark (conf/bench/NAME.yaml).

Overrides under `bench.` change the benchmark (e.g. `bench.measure_steps=10`); any other override
is added to every configuration (e.g. `cluster.num_gpus=16`). Results are appended to
outputs/bench/<name>/bench.jsonl, and bench.md / bench.png are rewritten from the latest run.
"""

from __future__ import annotations

import sys

from ftcore.bench.dispatch import normalise, task_for
from ftcore.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main("bench", task_for(args), normalise(args)))
