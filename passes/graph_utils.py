"""Small helpers shared by the graph passes: building nodes that carry fake values."""
from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map

# node.meta keys the passes share.
PARAM = "autoshard_param"  # on a collective: the name of the parameter it moves
GATHERED = "autoshard_gathered"  # on a copy-out node: its output is (part of) a gathered parameter


def val(node: Any) -> Any:
    """The fake value of a node (or the constant itself)."""
    return node.meta["val"] if isinstance(node, fx.Node) else node


def call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    """Insert ``target(*args)`` at the graph's insertion point, with its fake value in
    ``meta["val"]`` so the partitioner and Inductor see shapes as for a traced node."""
    node = graph.call_function(target, args)
    fake_args = tree_map(val, args)
    fake = next(a for a in fake_args if isinstance(a, torch.Tensor)).fake_mode
    with fake:
        node.meta["val"] = target(*fake_args)
    return node


def is_op(node: fx.Node, op: Any) -> bool:
    """Whether ``node`` calls ``op`` (an OpOverloadPacket or OpOverload)."""
    return node.op == "call_function" and (node.target is op or getattr(node.target, "overloadpacket", None) is op)
