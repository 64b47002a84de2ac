"""The environment a launcher (torchrun) gives each rank, set inside a run_ranks launch, so that
Lightning and the snippets join the ranks already started instead of starting their own."""
from __future__ import annotations

import os
import socket

import torch.distributed as dist


def free_port() -> int:
    """A port nothing listens on: a fixed one was now and then still taken by the launch before."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_launched(port: int) -> int:
    """Set this rank's torchrun variables (``port``: the same on every rank); returns the world size."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return world
