"""Overlap scheduling: issue collectives early and wait late, within a memory bound."""
from __future__ import annotations

from typing import Callable

from torch import fx

from autoshard._compat import c10d

from .graph_utils import GATHERED, collectives, exclusive_inputs, issue_inputs, nbytes, outputs_of, positions, reorder, wait_of


class _Gather:
    """One gather bucket: what moves with its issue, what moves with its wait, where it is used."""

    def __init__(self, node: fx.Node, pos: dict[fx.Node, int]) -> None:
        self.node = node
        self.issue = issue_inputs(node) + [node]
        self.outputs = outputs_of(wait_of(node))
        uses = [pos[u] for o in self.outputs for u in o.users if u not in self.outputs]
        self.first_use, self.last_use = min(uses), max(uses)
        # Live gathered bytes: the flat result plus the per-parameter copies made from it.
        self.nbytes = nbytes(node) + sum(nbytes(o) for o in self.outputs if o.meta.get(GATHERED))


def _peak(intervals: list[tuple[int, int, int]], lo: int, hi: int) -> int:
    """Largest total of (start, end, bytes) intervals alive at one point of [lo, hi]."""
    points = [lo] + [s for s, _, _ in intervals if lo <= s <= hi]
    return max(sum(b for s, e, b in intervals if s <= p <= e) for p in points)


def schedule_overlap(
    gm: fx.GraphModule,
    compute_time: Callable[[fx.Node], float],
    collective_time: Callable[[fx.Node], float],
    max_inflight_bytes: int | None = None,
    max_prefetch: int = 2,
    max_reduces_in_flight: int = 2,
) -> fx.GraphModule:
    """Reorder a bucketed forward or backward graph so communication hides behind compute.

    Guarantees, for each all-gather bucket j (in graph order): it is issued before the first
    use of bucket j - d, where the prefetch distance d (1..``max_prefetch``) is the smallest
    whose compute time (``compute_time`` summed over the nodes in between) covers
    ``collective_time`` of the gather; its wait and copy-out sit right before its first use.
    With ``max_inflight_bytes``, d shrinks (down to 0: gather at use) until the gathered bytes
    alive at once stay within the bound; a bound that not even d = 0 meets raises ValueError.
    Each gradient reduction (reduce-scatter, all-reduce) is issued right after its last input
    exists and waited right before the reduction of its kind ``max_reduces_in_flight``
    buckets later is issued, or at the end; an all-reduce of a reduce-scatter's result
    (hybrid sharding) is issued right after that reduce-scatter's wait.
    Numerics unchanged; deterministic (depends on graph structure, shapes and the cost functions).
    """
    graph = gm.graph
    pos = positions(graph.nodes)
    gathers = [_Gather(g, pos) for g in collectives(graph, c10d.all_gather_into_tensor.default)]
    # Reduce-scatters first: all-reduces may wait for them, never the other way round.
    reduce_kinds = [collectives(graph, op) for op in (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)]
    moved = {n for g in gathers for n in (*g.issue, *g.outputs)}
    reduce_issue = [[exclusive_inputs(r) + [r] for r in reduces] for reduces in reduce_kinds]
    reduce_outputs = [[outputs_of(wait_of(r)) for r in reduces] for reduces in reduce_kinds]
    moved |= {n for kind in reduce_issue + reduce_outputs for group in kind for n in group}

    # Compute time before each position, over the nodes that stay in place.
    elapsed, total = [], 0.0
    for node in graph.nodes:
        elapsed.append(total)
        if node not in moved:
            total += compute_time(node)

    priority: dict[fx.Node, float] = {n: float(p) for n, p in pos.items()}
    alive: list[tuple[int, int, int]] = []
    for j, g in enumerate(gathers):
        wanted = collective_time(g.node)
        hides = (d for d in range(1, max_prefetch + 1) if j - d < 0 or elapsed[g.first_use] - elapsed[gathers[j - d].first_use] >= wanted)
        d = next(hides, max_prefetch)
        while True:
            issue_at = g.first_use if d == 0 else (gathers[j - d].first_use if j - d >= 0 else 0)
            if max_inflight_bytes is None or _peak(alive, issue_at, g.last_use) + g.nbytes <= max_inflight_bytes:
                break
            if d == 0:
                need = _peak(alive, issue_at, g.last_use) + g.nbytes
                raise ValueError(
                    f"max_inflight_mb={max_inflight_bytes / 2**20:.3f} is below the {need / 2**20:.3f} MiB of gathered "
                    f"parameters this graph holds at once even without prefetching; raise max_inflight_mb or "
                    f"lower bucket_mb."
                )
            d -= 1
        alive.append((issue_at, g.last_use, g.nbytes))
        for n in g.issue:
            priority[n] = issue_at - 0.5 + j * 1e-6  # several issues at one point keep bucket order
        for n in g.outputs:
            priority[n] = g.first_use - 0.25  # after any issue placed at the same point

    end = float(len(pos))
    for reduces, issues, outputs_by_reduce in zip(reduce_kinds, reduce_issue, reduce_outputs):
        for issue in issues:  # inputs already rescheduled (a reduce-scatter's wait) count where they now are
            ready = max((priority[a] for n in issue for a in n.all_input_nodes if a not in issue), default=0)
            for n in issue:
                priority[n] = ready + 0.5
        for j, outputs in enumerate(outputs_by_reduce):
            later = j + max_reduces_in_flight
            wait_at = priority[reduces[later]] - 0.25 if later < len(reduces) else end
            for n in outputs:
                priority[n] = wait_at
    return reorder(gm, priority)
