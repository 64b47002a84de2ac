"""Which gathered parameters the forward keeps for the backward instead of resharding them.

Requires: the joint graph, its annotations lowered (each gathered parameter's full value).
Provides: the names of the parameters whose full values the partitioned forward saves; the
others' gathers are recomputed in the backward (``passes/lower.py`` tags them).

Always kept: the backward's first block (:func:`needed_first`): it adds nothing at the step's
peak. Given a memory budget, more repeated blocks, last first (the backward needs them
soonest), while an estimate of the step's peak stays within the budget less the room the
bucketed schedule needs beyond it (:func:`room`): the live bytes of the joint graph in its
order (forward, the turn, backward), a saved value live from its forward definition to its
last backward use, a resharded parameter's full value live over its forward uses and again over
its backward uses.
Each kept block spares a gather in the backward. Without a budget nothing more: measured on
gloo ranks, one more block kept cost its full bytes at the step's peak (docs/benchmarks.md).

Deterministic: graph order and fake shapes only.
"""
from __future__ import annotations

import itertools
from typing import Iterable

from torch import fx

from .graph_utils import arg, block_of, collective_kind, nbytes
from .storage import storage_roots


def needed_first(gathers: dict[str, fx.Node], order: dict[fx.Node, int]) -> set[str]:
    """Of ``gathers`` (a parameter's name -> its full value), those the backward needs first:
    the last repeated block the forward uses and every parameter first used after it starts
    (the final norm, an untied head); without blocks, the parameter used last. Kept gathered
    from forward to backward, they add nothing at the step's peak (the backward would gather
    them again at once) and their gathers, the backward's first, have no compute to hide behind."""
    first_use = {name: min((order[u] for u in full.users), default=-1) for name, full in gathers.items()}
    used = [name for name in first_use if first_use[name] >= 0]
    if not used:
        return set()
    in_blocks = [name for name in used if block_of(name) is not None]
    last = max(in_blocks or used, key=first_use.__getitem__)
    start = min(first_use[n] for n in used if block_of(n) == block_of(last)) if in_blocks else first_use[last]
    return {name for name in used if first_use[name] >= start}


def _turn(nodes: list[fx.Node], order: dict[fx.Node, int]) -> int:
    """The joint graph's first backward position: its first use of a tangent (AOT autograd
    traces the backward after the forward, the views it takes of saved values included)."""
    uses = [order[u] for n in nodes if n.op == "placeholder" and n.name.startswith("tangents") for u in n.users]
    return min(uses, default=len(nodes))


class _Live:
    """Live bytes of the joint graph by position, each parameter's full value kept or not."""

    def __init__(self, graph: fx.Graph, fulls: dict[str, fx.Node]) -> None:
        nodes = list(graph.nodes)
        self.size = len(nodes) + 1
        order = {n: i for i, n in enumerate(nodes)}
        turn = _turn(nodes, order)
        roots = storage_roots(graph)
        uses: dict[fx.Node, list[int]] = {}
        for n in nodes:
            r = roots[n]
            uses.setdefault(r, []).append(order[n])
            for u in n.users:
                uses[r].append(self.size - 1 if u.op == "output" else order[u])
        param_roots = {roots[full]: name for name, full in fulls.items()}
        # A gather's copy-in: its input, the shards it sends (the root of a full value is its gather).
        self.copy_in = {name: nbytes(arg(r, "input")) for r, name in param_roots.items() if collective_kind(r) == "all_gather"}
        self.base = [0] * (self.size + 1)
        self.kept: dict[str, list[tuple[int, int, int]]] = {}  # name -> intervals (bytes, start, end) if kept
        self.resharded: dict[str, list[tuple[int, int, int]]] = {}
        for r, at in uses.items():
            size = 0 if r.op == "placeholder" and r.name.startswith("tangents") else nbytes(r)
            if not size:
                continue
            start, end = (0 if r.op == "placeholder" else order[r]), max(at)
            name = param_roots.get(r)
            if name is None:
                self._add(self.base, size, start, end)
                continue
            forward, later = [i for i in at if i < turn], [i for i in at if i >= turn]
            self.kept.setdefault(name, []).append((size, start, end))
            self.resharded.setdefault(name, []).append((size, start, max(forward, default=start)))
            if later:  # gathered again just before its first backward use
                self.resharded[name].append((size, min(later), max(later)))

    @staticmethod
    def _add(diff: list[int], size: int, start: int, end: int) -> None:
        diff[start] += size
        diff[end + 1] -= size

    def peak(self, kept: set[str]) -> int:
        diff = list(self.base)
        for name in self.kept:
            for size, start, end in (self.kept if name in kept else self.resharded)[name]:
                self._add(diff, size, start, end)
        return max(itertools.accumulate(diff))

    def bytes_of(self, names: Iterable[str]) -> int:
        return sum(size for name in names for size, _, _ in self.kept.get(name, ()))


def room(live: _Live, blocks: list[list[str]]) -> int:
    """Bytes the bucketed schedule holds beyond the joint graph's liveness, at the least: one
    block's reduction in flight (its gradients copied into one flat buffer, and as many bytes
    received: two blocks' bytes) and one block's gather copying in its shards. One block of
    room was too little: budgets the schedule then could not meet with everything kept (12.7M
    GPT, 2 ranks) or one block more (4 ranks) failed the compile, though keeping fewer fits."""
    return max(2 * live.bytes_of(names) + sum(live.copy_in.get(n, 0) for n in names) for names in blocks)


def kept_for_backward(graph: fx.Graph, gathers: dict[str, fx.Node], order: dict[fx.Node, int],
                      budget_bytes: int | None = None) -> set[str]:
    """The parameters of ``gathers`` (name -> full value, each gathered once in the joint
    forward) to keep gathered for the backward: :func:`needed_first`, and with ``budget_bytes``,
    the blocks before it, last first, that fit the budget as the module docstring says."""
    kept = needed_first(gathers, order)
    if budget_bytes is None:
        return kept
    kept_blocks = {block_of(name) for name in kept}
    blocks: dict[str, list[str]] = {}  # block -> its parameters, the block the forward uses last first
    for name in sorted(gathers, key=lambda n: -min((order[u] for u in gathers[n].users), default=-1)):
        block = block_of(name)
        if block is not None and block not in kept_blocks:
            blocks.setdefault(block, []).append(name)
    if not blocks:
        return kept
    live = _Live(graph, gathers)
    candidates = list(blocks.values())  # last block first
    limit = budget_bytes - room(live, candidates)
    lo, hi = 0, len(candidates)  # the largest k whose last k blocks fit (the peak only grows with k)
    while lo < hi:
        k = (lo + hi + 1) // 2
        if live.peak(kept.union(*candidates[:k])) <= limit:
            lo = k
        else:
            hi = k - 1
    return kept.union(*candidates[:lo])
