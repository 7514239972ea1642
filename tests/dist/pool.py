"""A pool of gloo worker processes that runs many test cases per process group.

Starting a rank costs seconds (importing torch, megatron, transformers), so a session keeps one
2-rank and one 4-rank pool and sends each case to every rank as (function, args). The function runs
with the process group initialised and ftcore's CPU runtime active; it sets up megatron's parallel
state itself (trainer.setup or rdist.init_model_parallel). After each case the pool destroys the
parallel state, so the next case starts clean. One torch thread per rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _worker(rank: int, world: int, port: int, conn) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FTCORE_LOG_LEVEL="WARNING",
    )  # fmt: skip
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ftcore.runtime import cpu

    cpu.activate()
    from megatron.core import parallel_state as ps

    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test process
            conn.send(("err", traceback.format_exc()))
        finally:
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
    dist.destroy_process_group()


class Pool:
    def __init__(self, world: int):
        self.world = world
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, world, port, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, fn, *args, timeout: float = 600, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank; the per-rank results, or the first rank's traceback."""
        for c in self.conns:
            c.send((fn, args, kwargs))
        results, errors = [], []
        for rank, c in enumerate(self.conns):
            if not c.poll(timeout):
                self.close(kill=True)
                raise TimeoutError(f"rank {rank} did not finish within {timeout} s")
            status, value = c.recv()
            (results if status == "ok" else errors).append(value if status == "ok" else f"[rank {rank}]\n{value}")
        if errors:
            raise RuntimeError("a rank failed:\n" + "\n".join(errors))
        return results

    def close(self, kill: bool = False) -> None:
        for c, p in zip(self.conns, self.procs):
            if not kill and p.is_alive():
                try:
                    c.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
