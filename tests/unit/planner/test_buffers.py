"""The DDP buffer laid out from runs of identical layers (ftcore/planner/buffers.py) equals the
same buffer laid out one parameter at a time, by megatron's rules written out plainly here:
reverse registration order, each parameter at a multiple of 64 with the distributed optimizer, the
size padded to lcm(dp, 128), rank i owning [i*n/dp, (i+1)*n/dp). (The per-parameter layout itself
is checked against megatron's allocation in tests/multiproc/test_planner_bytes.py.)"""

from __future__ import annotations

import math
import random

from ftcore.planner import buffers


def one_by_one(blocks, distributed: bool, dp: int, dp_rank: int) -> tuple[int, int, int]:
    params = [n for numels, count in blocks for _ in range(count) for n in numels]
    ranges, pos = [], 0
    for n in reversed(params):
        if distributed:
            pos = -(-pos // 64) * 64
        ranges.append((pos, pos + n))
        pos += n
    size = -(-pos // math.lcm(dp, 128)) * math.lcm(dp, 128) if distributed else pos
    lo, hi = size // dp * dp_rank, size // dp * (dp_rank + 1)
    inside = [min(b, hi) - max(a, lo) for a, b in ranges]
    return size, sum(n for n in inside if n > 0), sum(n > 0 for n in inside)


def test_runs_lay_out_the_buffer_as_one_parameter_at_a_time():
    rng = random.Random(0)
    for _ in range(300):
        blocks = [([rng.choice([1, 7, 63, 64, 65, 130, 4096, 5000]) for _ in range(rng.randint(0, 5))],
                   rng.randint(1, 9)) for _ in range(rng.randint(1, 6))]  # fmt: skip
        distributed, dp = rng.random() < 0.8, rng.choice([1, 2, 3, 8, 24])
        runs, size = buffers.layout(blocks, distributed, dp)
        for dp_rank in {0, dp // 2, dp - 1}:
            assert (size, *buffers.shard(runs, size, dp, dp_rank)) == one_by_one(
                blocks, distributed, dp, dp_rank
            ), (blocks, distributed, dp, dp_rank)
