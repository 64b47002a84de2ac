"""Which gathered parameters the forward keeps for the backward instead of resharding them.

Requires: the joint graph, its annotations lowered (each gathered parameter's full value).
Provides: the names of the parameters whose full values the partitioned forward saves; the
others' gathers are recomputed in the backward (``passes/lower.py`` tags them).

Always kept: the backward's first block (:func:`needed_first`): it adds nothing at the step's
peak. Given a memory budget, more repeated blocks, last first (the backward needs them
soonest), while an estimate of the least the bucketed graphs need (:class:`_LiveBytes`) stays within
the budget less one activation (the partitioner recomputes cheap values in the backward beside
those it saves). The estimate is the live bytes of the joint graph in its order (forward, the
turn, backward): the inputs (parameter shards, the batch) through the whole step, a saved value
live from its forward definition to its last backward use, a resharded parameter's full value
live over its forward uses and again over its backward uses, a block's gather copying in its
shards where it runs, and a block's reduction holding two blocks' bytes (its gradients copied
into one flat buffer, as many received) where its last gradient is made. A room of one block
added at the peak instead let budgets fail the compile (12.7M GPT), and one that let kept
blocks' shards die after the forward did too (bench/real.py's default GPT, a budget equal to
the default's need): each kept more than the schedule could then fit.
Each kept block spares a gather in the backward. Without a budget nothing more: measured on
gloo ranks, one more block kept cost its full bytes at the step's peak (docs/benchmarks.md).

Deterministic: graph order and fake shapes only.
"""
from __future__ import annotations

import itertools

from torch import fx

from .graph_utils import PARAMS, arg, block_of, collective_kind, nbytes
from .step_model import storage_roots

KEPT_BLOCKS = "autoshard_kept_blocks"  # on a lowered joint graph: the blocks kept beyond needed_first


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


def backward_start(nodes: list[fx.Node], order: dict[fx.Node, int]) -> int:
    """The joint graph's first backward position: its first use of a tangent (AOT autograd
    traces the backward after the forward, the views it takes of saved values included)."""
    uses = [order[u] for n in nodes if n.op == "placeholder" and n.name.startswith("tangents") for u in n.users]
    return min(uses, default=len(nodes))


def _group(name: str) -> str:
    return block_of(name) or name  # the bucketing pass buckets a block's parameters together


class _LiveBytes:
    """Live bytes of the joint graph by position, each parameter's full value kept or not:
    what the bucketed graphs hold at the least (each bucket gathered at its use, each reduction
    waited at once), as the module docstring says."""

    def __init__(self, graph: fx.Graph, fulls: dict[str, fx.Node]) -> None:
        nodes = list(graph.nodes)
        self.size = len(nodes) + 1
        order = {n: i for i, n in enumerate(nodes)}
        turn = backward_start(nodes, order)
        roots = storage_roots(graph)
        uses: dict[fx.Node, list[int]] = {}
        for n in nodes:
            r = roots[n]
            uses.setdefault(r, []).append(order[n])
            for u in n.users:
                uses[r].append(self.size - 1 if u.op == "output" else order[u])
        param_roots = {roots[full]: name for name, full in fulls.items()}
        # A gather's copy-in: its input, the shards it sends (the root of a full value is its gather).
        copy_in = {name: nbytes(arg(r, "input")) for r, name in param_roots.items() if collective_kind(r) == "all_gather"}
        self.base = [0] * (self.size + 1)
        self.largest_activation = 0  # the largest value the forward makes, parameters' aside
        self.kept: dict[str, list[tuple[int, int, int]]] = {}  # name -> intervals (bytes, start, end) if kept
        self.resharded: dict[str, list[tuple[int, int, int]]] = {}
        for r, at in uses.items():
            size = 0 if r.op == "placeholder" and r.name.startswith("tangents") else nbytes(r)
            if not size:
                continue
            # Inputs live through the step: parameter shards (the optimizer steps them), the batch.
            start, end = (0, self.size - 1) if r.op == "placeholder" else (order[r], max(at))
            name = param_roots.get(r)
            if name is None:
                self._add(self.base, size, start, end)
                if r.op != "placeholder" and start < turn:
                    self.largest_activation = max(self.largest_activation, size)
                continue
            forward, later = [i for i in at if i < turn], [i for i in at if i >= turn]
            self.kept.setdefault(name, []).append((size, start, end))
            self.resharded.setdefault(name, []).append((size, start, max(forward, default=start)))
            if later:  # gathered again just before its first backward use, its shards copied in
                self.resharded[name] += [(size, min(later), max(later)), (copy_in.get(name, 0), min(later), min(later))]
        self._add_collectives(nodes, order, param_roots, copy_in)

    def _add_collectives(self, nodes: list[fx.Node], order: dict[fx.Node, int], param_roots: dict[fx.Node, str],
                         copy_in: dict[str, int]) -> None:
        """A bucket's gather copies its shards in where its first gather runs; its reduction
        holds its gradients copied into one flat buffer and as many bytes received where its
        last gradient is made (a bucket: a block's parameters)."""
        gathers: dict[str, list[tuple[int, int]]] = {}  # bucket -> (position, bytes) of each parameter
        for r, name in param_roots.items():
            gathers.setdefault(_group(name), []).append((order[r], copy_in.get(name, 0)))
        for group in gathers.values():
            at = min(i for i, _ in group)
            self._add(self.base, sum(b for _, b in group), at, at)
        reduces: dict[str, list[tuple[int, int]]] = {}
        for n in (n for n in nodes if collective_kind(n) == "reduce_scatter"):
            for name in n.meta.get(PARAMS, ()):
                reduces.setdefault(_group(name), []).append((order[n], nbytes(arg(n, "input"))))
        for group in reduces.values():
            at = max(i for i, _ in group)
            self._add(self.base, 2 * sum(b for _, b in group), at, at)

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


def extra_blocks(kept: set[str], gathers: dict[str, fx.Node], order: dict[fx.Node, int]) -> int:
    """How many blocks of ``kept`` :func:`needed_first` does not keep."""
    return len({block_of(n) for n in kept} - {block_of(n) for n in needed_first(gathers, order)})


def kept_for_backward(graph: fx.Graph, gathers: dict[str, fx.Node], order: dict[fx.Node, int],
                      budget_bytes: int | None = None, at_most: int | None = None) -> set[str]:
    """The parameters of ``gathers`` (name -> full value, each gathered once in the joint
    forward) to keep gathered for the backward: :func:`needed_first`, and with ``budget_bytes``,
    the blocks before it, last first, that fit the budget as the module docstring says, no
    more than ``at_most`` of them (the backend's cap when it compiles again, having kept more
    than the schedule could fit)."""
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
    live = _LiveBytes(graph, gathers)
    candidates = list(blocks.values())  # last block first
    # The partitioner recomputes cheap values in the backward beside those it saves: one activation more.
    limit = budget_bytes - live.largest_activation
    # The largest k (at most at_most) whose last k blocks fit: the peak only grows with k.
    lo, hi = 0, len(candidates) if at_most is None else min(at_most, len(candidates))
    while lo < hi:
        k = (lo + hi + 1) // 2
        if live.peak(kept.union(*candidates[:k])) <= limit:
            lo = k
        else:
            hi = k - 1
    return kept.union(*candidates[:lo])
