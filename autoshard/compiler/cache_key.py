"""autoshard's part of the compile caches' key: everything besides the Dynamo graph (which
PyTorch keys on itself) that changes what the backend compiles.

PyTorch's AOT autograd cache, on a hit, skips the joint pass, the partitioner and the inner
compiler, autoshard's passes with them; so the key must hold every input of those passes:
the options (strategy, budget, bucket caps ...), the device profile as resolved (a calibrated
``.json`` profile by content), the world size, the process groups the graph names (by
backend and the shape of their ranks) and autoshard's own code. Torch's version is already
in PyTorch's key. The same inputs give the same plan on every rank, so ranks that agree on
the key run the same collectives whether their compile hit or missed (docs/caching.md).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

import autoshard.passes as autoshard_passes
from autoshard.compiler.ghosts import UNSHARD_ALL
from autoshard.compiler.options import Options
from autoshard.cost.cost_model import DeviceProfile
from autoshard.passes.graph_utils import group_backend, group_ranks
from autoshard.runtime.batched import calls_of
from autoshard.runtime.ops import arguments


def _version() -> str:
    try:
        return importlib.metadata.version("autoshard")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout
        return "unknown"


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """A hash of autoshard's source files (the package and its passes)."""
    digest = hashlib.sha256()
    # The passes are a package of their own in a checkout (passes/), mapped to autoshard.passes.
    folders = {"autoshard": Path(__file__).resolve().parents[1], "autoshard.passes": Path(autoshard_passes.__file__).resolve().parent}
    for name, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            digest.update(f"{name}/{path.relative_to(folder)}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def _groups(gm: fx.GraphModule) -> list[tuple[str, Any, Any]]:
    """The process groups the graph's gathers name (the shard groups, and the node groups of
    ``reshard_after_forward=G``): name, backend and ranks relative to the lowest."""
    names = set()
    for node in gm.graph.find_nodes(op="call_function", target=UNSHARD_ALL):
        for op, rest in calls_of(node.args[1]):
            found = arguments(op, (None, *rest))
            names.update(n for n in (found["group_name"], found.get("node_group")) if n)
    found = []
    for name in sorted(names):
        ranks = group_ranks(name)
        shape = None if ranks is None else tuple(r - min(ranks) for r in sorted(ranks))
        found.append((name, group_backend(name), shape))
    return found


def cache_key(gm: fx.GraphModule, opts: Options, profile: DeviceProfile) -> str:
    """autoshard's part of the cache key of compiling ``gm`` (after the capture) with ``opts``
    and ``profile``. Leaves out ``debug_dir``: it changes what is written, not what is compiled."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    options = {k: v for k, v in dataclasses.asdict(opts).items() if k != "debug_dir"}
    parts = (_version(), code_hash(), sorted(options.items()), dataclasses.asdict(profile), world, _groups(gm))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def graph_key(gm: fx.GraphModule, example_inputs: Any, key: str) -> str:
    """``key`` with the graph's code and its inputs' shapes, dtypes and requires_grad: what the
    ranks compare before a compile the caches may serve (consistency.keys_agree)."""
    inputs = [(tuple(x.shape), str(x.dtype), x.requires_grad) if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs]
    return hashlib.sha256(repr((key, gm.code, inputs)).encode()).hexdigest()[:32]
