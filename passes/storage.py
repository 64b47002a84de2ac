"""Which node allocated the storage each node of a graph uses (views, waits and in-place ops
return an existing one): what the liveness of the gloo buffers and of the kept blocks reads."""
from __future__ import annotations

import operator

from torch import fx

from autoshard._compat import schema_of

from .graph_utils import is_view, is_wait, out_buffer


def _returns_its_input(node: fx.Node) -> bool:
    # An in-place op (copy_ into a slice of a bucket, as PyTorch's bucketer does) returns its
    # first argument: its schema's return shares that argument's alias set.
    schema = schema_of(node.target)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def storage_roots(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """node -> the node that allocated the storage it uses (itself when it allocates)."""
    root: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        base = out_buffer(n)
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if base is None and first is not None and (
            is_view(n, hidden=True) or is_wait(n) or _returns_its_input(n)
            or (n.target is operator.getitem and is_view(first, hidden=True))  # a piece of split(...)
        ):
            base = first
        root[n] = root.get(base, base) if base is not None else n
    return root
