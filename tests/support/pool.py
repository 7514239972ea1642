"""A pool of gloo worker processes that runs many test cases per process group.

Starting a rank costs seconds (importing torch, megatron, transformers), so a session keeps one
2-rank and one 4-rank pool and sends each case to every rank as (function, args). The function runs
with the process group initialised and ftcore's CPU runtime active; it sets up megatron's parallel
state itself (trainer.setup or rdist.init_model_parallel). After each case the pool destroys the
parallel state, so the next case starts clean. One torch thread per rank.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

from tests.support.rendezvous import host_store, rank_env

ROOT = Path(__file__).resolve().parents[2]
GRACE = 30.0  # seconds the other ranks get once one rank has failed
# megatron's DDP registers hooks on the parameters' grad accumulators (C++ autograd nodes) that
# point back at the DDP module: a cycle the garbage collector cannot see, so each case with data
# parallelism leaks its model and the gloo threads of its groups. A worker that has gathered this
# many threads is replaced (about 10 s) before the leak slows everything else down.
MAX_THREADS = 200


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task")) if os.path.isdir("/proc") else 0


def _worker(rank: int, world: int, env: dict, conn) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.update(
        env,  # joins the store the pool hosts (tests/support/rendezvous.py)
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        FTCORE_LOG_LEVEL="WARNING",
    )  # fmt: skip
    import warnings

    warnings.filterwarnings("ignore")
    sys.modules.setdefault("wandb", None)  # no case logs to wandb (ftcore.cli.skip_unused_imports)
    from ftcore.runtime import megatron_jit

    megatron_jit.install()  # as ftcore's entry points do (ftcore/cli.py)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ftcore.runtime import cpu, run_lock

    cpu.activate()
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d as c10d

    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        groups = set(c10d._world.pg_map)
        try:
            result = ("ok", fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - reported to the test process
            result = ("err", traceback.format_exc())
        run_lock.release()  # as an entry point ends its run (ftcore/train.py): run.dir is free
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        # megatron's destroy drops its groups without shutting them down: each gloo group keeps
        # its TCP loop threads, and hundreds of cases leave thousands of runnable threads that
        # slow the whole suite to a crawl. Shut down every group this case created.
        for pg in [g for g in c10d._world.pg_map if g not in groups]:
            dist.destroy_process_group(pg)
        gc.collect()  # the case's model and optimizer hold the groups in reference cycles
        conn.send((*result, _threads()))
    dist.destroy_process_group()
    from ftcore.cli import exit_process

    exit_process(0)  # as ftcore's entry points end: without seconds of module teardown


class Pool:
    """World-size `world` gloo workers. A case that fails or hangs costs the pool: it is killed and
    started afresh on the next run(), so one broken case never stalls the cases after it."""

    def __init__(self, world: int):
        self.world = world
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.store = host_store(self.world)
        env = rank_env(self.store)
        self.conns, self.procs = [], []
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world, env, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, fn, *args, timeout: float = 420, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank; the per-rank results, or every failed rank's traceback.

        timeout (below pytest's 600 s, so the pool cleans up before pytest gives up) bounds the
        whole case; once a rank has failed, the others get GRACE seconds before they count as hung
        (they may be waiting in a collective for the failed one)."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close(kill=True)
            self._start()
        for c in self.conns:
            c.send((fn, args, kwargs))
        deadline = time.monotonic() + timeout
        results, errors, worn = [], [], False
        for rank, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                self.close(kill=True)
                msg = f"rank {rank} did not finish within {timeout:.0f} s"
                raise TimeoutError("\n".join([msg, *errors]))
            status, value, threads = c.recv()
            worn = worn or threads > MAX_THREADS
            if status == "ok":
                results.append(value)
            else:
                errors.append(f"[rank {rank}]\n{value}")
                deadline = min(deadline, time.monotonic() + GRACE)
        if errors or worn:
            self.close(kill=True)
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
                p.join(timeout=10)
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []
