"""Remove collectives whose results nothing reads."""
from __future__ import annotations

from torch import fx

from autoshard._compat import c10d

_C10D = c10d.wait_tensor.default.namespace


def _impure(node: fx.Node) -> bool:
    # Collectives count as side effects to FX, so dead-code elimination keeps them; ours
    # are pure functions of their inputs (every rank prunes the same ones).
    if node.op == "call_function" and getattr(node.target, "namespace", None) == _C10D:
        return False
    return node.is_impure()


def prune_unused_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Erase functional collectives (and the nodes feeding only them) whose results no node uses.

    The partitioner can copy a recomputed gather into the backward although the node that
    read it there was replaced by a saved value; left in, it moves bytes for nothing.
    Guarantees: every remaining collective's wait has a user; nothing else changes.
    Deterministic, since it depends only on the graph.
    """
    if gm.graph.eliminate_dead_code(is_impure_node=_impure):
        gm.recompile()
    return gm
