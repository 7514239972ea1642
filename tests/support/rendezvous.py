"""The rendezvous store a test process hosts for the ranks it starts.

Picking a free port and handing it to rank 0, which binds it seconds later (after importing torch
and megatron), races every other process on the machine: under xdist, gloo's own connections take
ephemeral ports all the time, and rank 0 then fails with EADDRINUSE. So the test process binds
port 0 itself, keeps the store open while its ranks live, and the ranks join it as clients.
"""

from __future__ import annotations

import torch.distributed as dist

ADDR = "127.0.0.1"


def host_store(world: int) -> dist.TCPStore:
    """A store on a port the kernel picked, already listening; `.port` is the one to hand out."""
    return dist.TCPStore(ADDR, 0, world, is_master=True, wait_for_workers=False)


def rank_env(store: dist.TCPStore) -> dict[str, str]:
    """The variables that make torch's env:// rendezvous join `store` as a client on every rank,
    as the ranks torchrun starts join its agent's store (TORCHELASTIC_USE_AGENT_STORE)."""
    return {
        "MASTER_ADDR": ADDR,
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
