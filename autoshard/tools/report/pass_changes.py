"""What each pass changed: from one stage's graph to the next, nodes added and removed by
operation, nodes moved, and the collectives (and buckets) formed."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import fx

from autoshard.compiler.pipeline import what_happened
from autoshard.cost.cost_model import collective_of
from autoshard.passes.graph_utils import PARAMS


def op_label(node: fx.Node) -> str:
    """A node's operation: ``aten.mm.default``, ``getitem``, ``.to_local`` (a method),
    ``module:blocks.0.fc`` or the node kind (``placeholder``, ``output``, ``get_attr``)."""
    if node.op == "call_function":
        return str(node.target) if hasattr(node.target, "overloadpacket") else getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_module":
        return f"module:{node.target}"
    return node.op


def _moved(before: list[str], after: list[str]) -> int:
    """Fewest nodes to move to turn ``before``'s order of the shared names into ``after``'s:
    those outside a longest increasing subsequence of their new positions."""
    where = {name: i for i, name in enumerate(after)}
    positions = [where[name] for name in before if name in where]
    tails: list[int] = []  # patience sorting: tails[k] = smallest tail of an increasing run of k+1
    for p in positions:
        lo, hi = 0, len(tails)
        while lo < hi:
            mid = (lo + hi) // 2
            if tails[mid] < p:
                lo = mid + 1
            else:
                hi = mid
        tails[lo:lo + 1] = [p]
    return len(positions) - len(tails)


@dataclass(frozen=True)
class PassSummary:
    """What changed from stage ``before`` to stage ``after``.

    added / removed: node counts by :func:`op_label` (multiset difference); moved: surviving
    nodes (same name in both) that changed relative order, counted as the fewest moves;
    collectives: per kind, ``(collectives, parameters they move)`` in ``after`` when it is
    the first bucketed (or final) stage; a parameter count above the collective count means
    buckets were formed.
    """

    before: str
    after: str
    what: str
    nodes_before: int
    nodes_after: int
    added: dict[str, int]
    removed: dict[str, int]
    moved: int
    collectives: dict[str, tuple[int, int]]

    def text(self, top: int = 4) -> str:
        def ops(counts: dict[str, int]) -> str:
            items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
            shown = ", ".join(f"{k.removeprefix('aten.').removeprefix('_c10d_functional.')} x{v}" for k, v in items[:top])
            more = f", ... {len(items) - top} more ops" if len(items) > top else ""
            return f"{sum(counts.values())} ({shown}{more})" if counts else "0"

        parts = [
            f"{self.before} -> {self.after}: {self.what}.",
            f"nodes {self.nodes_before} -> {self.nodes_after}; added {ops(self.added)}; removed {ops(self.removed)}; moved {self.moved}",
        ]
        for kind, (n, params) in self.collectives.items():
            parts.append(f"{kind}: {params} parameters in {n} collectives" + (" (bucketed)" if params > n else ""))
        return " ".join(parts[:1]) + " " + "; ".join(parts[1:]) + "."


def _collective_counts(gm: fx.GraphModule) -> dict[str, tuple[int, int]]:
    counts: dict[str, list[int]] = {}
    for node in gm.graph.nodes:
        if (c := collective_of(node)) is not None:
            entry = counts.setdefault(c.kind, [0, 0])
            entry[0] += 1
            # Lowering names one parameter per collective; bucketing concatenates the names.
            entry[1] += max(1, len(node.meta.get(PARAMS, ())))
    return {k: (v[0], v[1]) for k, v in counts.items()}


def summarize_pass(before: str, after: str, a: fx.GraphModule, b: fx.GraphModule) -> PassSummary:
    """The :class:`PassSummary` of going from graph ``a`` (stage ``before``) to ``b``."""
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    ca, cb = Counter(map(op_label, na)), Counter(map(op_label, nb))
    first_partitioned = after.endswith("_bucketed") or before in ("captured", "lowered")
    return PassSummary(
        before, after, what_happened(before, after),
        len(na), len(nb), dict(cb - ca), dict(ca - cb),
        _moved([n.name for n in na], [n.name for n in nb]),
        _collective_counts(b) if first_partitioned and after not in ("joint", "lowered") else {},
    )
