"""Capture: the Dynamo graph's ghost inputs become shards, gathered by one op.

While Dynamo traces a synchronised forward, each sharded parameter read returns the
parameter's *ghost* (autoshard/runtime/leaves.py): a graph input of the full parameter's
shape that Dynamo traces like a plain parameter, not a custom op per use, which costs Dynamo
far more (docs/design.md, "2. Capture", has the figures). Before anything else sees the graph,
the backend gives each ghost input its leaf (the shard, a plain tensor) instead and gathers
them right after the inputs::

    w_ghost (placeholder)                 w_leaf (placeholder)     the same node: its source stays
    mm(x, w_ghost)            ->          full = unshard_all([w_leaf, ...], key)  trainable; frozen in a second call
                                          mm(x, full[0])

At run time the compiled graph is handed each ghost's current leaf in its place
(:func:`with_leaves`). ``unshard_all`` is split back into per-parameter ops on the joint
graph (passes/unbatch.py).

Requires: a Dynamo graph and its example inputs. Provides: no ghost among them; every
sharded parameter of a synchronised forward gathered by ``autoshard::unshard_all``.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Sequence

import torch
from torch import fx

from autoshard._compat import detect_fake_mode
from autoshard.runtime.batched import key_for
from autoshard.runtime.errors import UsageError
from autoshard.runtime.leaves import Leaves, ghost_leaves
from autoshard.runtime.ops import FAKE

UNSHARD_ALL = torch.ops.autoshard.unshard_all.default
ALIAS = torch.ops.aten.alias.default


def _fake(value: torch.Tensor) -> Any:
    """``value`` as a fake tensor of the compile's fake mode (None: there is none), of static
    shape: made here first, it is the one AOT autograd then finds for ``value``."""
    mode = detect_fake_mode()
    return None if mode is None else mode.from_tensor(value, static_shapes=True)


def gather_ghosts(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[list[Any], tuple[int, ...]]:
    """Rewrite ``gm`` in place as the module docstring draws; return its example inputs with
    each ghost replaced by its leaf, and the positions of those inputs."""
    graph = gm.graph
    for node in graph.find_nodes(op="get_attr"):  # a ghost Dynamo kept as a constant would be computed with
        if ghost_leaves(getattr(gm, node.target, None)) is not None:
            raise UsageError(f"autoshard backend: Dynamo made the sharded parameter read {node.target!r} a constant of "
                             "the graph, not an input, so it cannot be gathered; leave "
                             "torch._dynamo.config.inline_inbuilt_nn_modules at True (its default).")
    placeholders = list(graph.find_nodes(op="placeholder"))
    found: list[tuple[int, fx.Node, Leaves]] = []
    for i, (node, x) in enumerate(zip(placeholders, example_inputs)):
        leaves = ghost_leaves(x)
        if leaves is not None:
            found.append((i, node, leaves))
            for read in [u for u in node.users if u.target is ALIAS]:  # each read (runtime/sharded.py)
                read.replace_all_uses_with(node)
                graph.erase_node(read)
    if not found:
        return list(example_inputs), ()
    inputs = list(example_inputs)
    groups: dict[bool, list[tuple[fx.Node, Leaves]]] = {True: [], False: []}
    for i, node, leaves in found:
        inputs[i] = leaves.leaf
        groups[leaves.leaf.requires_grad].append((node, leaves))
    with graph.inserting_before(placeholders[-1].next):  # right after the inputs, in this order
        for members in (groups[True], groups[False]):
            if members:
                _gather(graph, members)
    graph.lint()
    gm.recompile()
    return inputs, tuple(i for i, _, _ in found)


def _gather(graph: fx.Graph, members: list[tuple[fx.Node, Leaves]]) -> None:
    calls = [(leaves.spec.op, (*leaves.spec.head, None, *leaves.spec.tail)) for _, leaves in members]
    batch = graph.call_function(UNSHARD_ALL, ([node for node, _ in members], key_for(calls)))
    fulls = []
    for j, (node, _) in enumerate(members):
        full = graph.call_function(operator.getitem, (batch, j))
        node.replace_all_uses_with(full, delete_user_cb=lambda user: user is not batch)
        fulls.append(full)
    # Dynamo's values, for the inner compiler's passes that read them: the leaf, the full
    # parameter (contiguous, where the ghost's strides were 0).
    for (node, leaves), full, (op, rest) in zip(members, fulls, calls):
        leaf = _fake(leaves.leaf)
        if leaf is not None:
            node.meta["example_value"] = leaf
            with leaf.fake_mode:
                full.meta["example_value"] = FAKE[op](leaf, *rest)  # the op's fake kernel, without its dispatch
    if all("example_value" in f.meta for f in fulls):
        batch.meta["example_value"] = [f.meta["example_value"] for f in fulls]


def with_leaves(compiled: Callable, positions: tuple[int, ...]) -> Callable:
    """``compiled``, called with the current leaf of each ghost at ``positions`` instead."""
    if not positions:
        return compiled

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        args = list(args)
        for i in positions:
            args[i] = ghost_leaves(args[i]).leaf
        return compiled(*args)

    return run
