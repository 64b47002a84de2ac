"""Collective operations that fail on every rank within seconds when one rank fails.

A rank that raises between two collectives leaves its peers blocked in the next one until the
process group's timeout (30 minutes by default), or forever. :func:`fail_together` runs a
block on a process group of its own: a rank that raises records its error in the store and
closes that group, which breaks its peers' pending collectives at once ("connection closed");
each peer then raises an error naming the rank that failed first and what it raised. A block
that ends normally ends with a barrier, so a rank that failed after its last collective fails
the others there.

    with fail_together("autoshard.save") as link:
        dcp.save(state, process_group=link.group)

Why a group of its own: a gloo group's connections close only when its last reference goes
(``abort()`` and ``shutdown()`` leave a pending peer waiting), so the failing rank must drop
every reference to it, the frames of its traceback included; the user's groups are not ours
to close.

:func:`check_same_on_all_ranks` is the same promise for decisions: ranks that would disagree
on what to shard raise the same error together instead of hanging in mismatched collectives.
"""
from __future__ import annotations

import gc
import hashlib
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from autoshard._compat import default_store
from autoshard.runtime.errors import RankFailedError, UsageError

# How long a rank whose collective broke waits for the failing rank's message.
_SETTLE = timedelta(seconds=10)


@dataclass
class Link:
    """The block's process group (None without a multi-rank group: nothing to coordinate)."""

    group: dist.ProcessGroup | None


def multi_rank() -> bool:
    """A real process group with more than one rank (not the fake one)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


def _clear_frames(error: BaseException | None) -> None:
    """Drop the locals of every finished frame in ``error``'s traceback and its causes: they
    hold references to the group (DCP's wrappers, our own arguments)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def recorded_failure(key: str) -> tuple[int, str] | None:
    """(rank, message) of the first failure recorded under ``key``, if any."""
    store = default_store()
    if not store.check([f"{key}/first"]):
        return None
    first, message = store.get(f"{key}/first").decode().split("\n", 1)
    return int(first), message


def first_failure(key: str, rank: int, error: BaseException) -> tuple[int, str]:
    """Record ``error`` under ``key`` unless another rank did first; return (rank, message) of
    the first failure."""
    store = default_store()
    if store.add(f"{key}/count", 1) == 1:
        store.set(f"{key}/first", f"{rank}\n{type(error).__name__}: {error}")
    try:
        store.wait([f"{key}/first"], _SETTLE)
    except RuntimeError:  # the first rank died before writing: name nobody
        return rank, f"{type(error).__name__}: {error}"
    return recorded_failure(key)


@contextmanager
def fail_together(what: str) -> Iterator[Link]:
    """Run the block on every rank; if it raises on one, it raises on all within seconds.

    The rank that failed first re-raises its own error; ranks whose collectives broke raise
    ``RuntimeError`` ("``what``: failed on rank R: ...") chained to what they saw; a rank that
    raised an error of its own re-raises it. Call it on every rank, as any
    collective. Costs one new gloo group (its connections) and two barriers per block.
    """
    if not multi_rank():
        yield Link(None)
        return
    rank = dist.get_rank()
    link = Link(dist.new_group(backend="gloo"))
    key = f"autoshard/failed/{link.group.group_name}"
    try:
        # Every rank connected before any may close the group: a rank that failed at once
        # would otherwise break a peer still connecting, with gloo's error instead of ours.
        dist.barrier(group=link.group)
        yield link
        dist.barrier(group=link.group)
    except BaseException as error:
        failed_rank, message = first_failure(key, rank, error)
        _close(link, error)
        # A broken collective raises RuntimeError; an error of this rank's own (a ValueError
        # every rank found alike) is re-raised as it is.
        if failed_rank != rank and isinstance(error, RuntimeError):
            raise RankFailedError(f"{what}: failed on rank {failed_rank}: {message} (rank {rank} stopped with it); "
                               f"fix the error rank {failed_rank} raised (its own traceback shows where).") from error
        raise
    dist.destroy_process_group(link.group)


def _close(link: Link, error: BaseException) -> None:
    """Close the block's group now, so that peers blocked in it stop waiting."""
    group, link.group = link.group, None
    _clear_frames(error)
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError):  # already gone
        pass
    del group
    gc.collect()  # the group may sit in a reference cycle


def _digest(items: list) -> int:
    return int.from_bytes(hashlib.sha256(repr(items).encode()).digest()[:8], "little", signed=True)


def _first_difference(mine: list, theirs: list) -> int:
    return next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))


def check_same_on_all_ranks(what: str, items: list, device: str) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks pass equal ``items``.

    One all-gather of a hash (on ``device``, the default group's); only when hashes differ are
    the lists themselves exchanged, so that every rank can name the first difference between
    rank 0 and the first rank that differs from it.
    """
    if not multi_rank():
        return
    world = dist.get_world_size()
    digests = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(digests, torch.tensor([_digest(items)], dtype=torch.int64, device=device))
    if len({int(d) for d in digests}) == 1:
        return
    every: list[list] = [[] for _ in range(world)]
    dist.all_gather_object(every, items)
    other = next(r for r in range(1, world) if every[r] != every[0])
    i = _first_difference(every[0], every[other])
    has = lambda r: repr(every[r][i]) if i < len(every[r]) else "nothing more"  # noqa: E731
    raise UsageError(
        f"{what}: ranks disagree on what to shard; first difference, at entry {i}: rank 0 has {has(0)}, "
        f"rank {other} has {has(other)}. Every rank must build the same model (same config, same code path) "
        "and call it with the same arguments."
    )
