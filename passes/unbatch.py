"""Split the batched annotation ops back into one op per parameter, each where it is needed."""
from __future__ import annotations

import operator

import torch
from torch import fx

from autoshard.runtime.batched import calls_of

from .graph_utils import Replacer, arg, is_op

annotations = torch.ops.autoshard


def _after(node: fx.Node) -> fx.Node:
    """The node to insert after so as to follow ``node`` (past the inputs, which come first)."""
    while node.next.op == "placeholder":
        node = node.next
    return node


def unbatch_annotations(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace ``unshard_all`` and ``reduce_all`` (autoshard/runtime/batched.py) with the
    per-parameter annotation ops they stand for.

    Guarantees: output ``i`` of ``unshard_all(tensors, key)`` becomes ``op_i(tensors[i],
    *args_i)`` (``unshard`` or ``replicate``) just before its first user, as if the parameter
    had been read there; output ``i`` of ``reduce_all(grads, key)`` becomes ``op_i(grads[i],
    *args_i)`` (``reduce_grad`` or ``all_reduce_grad``) just after ``grads[i]`` is made, as
    autograd calls a parameter's own backward once its gradient is complete. Outputs nobody
    uses are dropped. Afterwards the graph is what one annotation op per parameter would have
    traced: every pass after it is unchanged. Idempotent.

    Drawn (forward; ``w`` first used by ``mm2``)::

        b = unshard_all([v, w], k)                 mm1 = mm(x, unshard(v, ...))
        mm1 = mm(x, b[0])              ->          w_full = unshard(w, ...)
        mm2 = mm(mm1, b[1])                        mm2 = mm(mm1, w_full)
    """
    graph = gm.graph
    batches = [*graph.find_nodes(op="call_function", target=annotations.unshard_all.default),
               *graph.find_nodes(op="call_function", target=annotations.reduce_all.default)]
    if not batches:
        return gm
    order = {n: i for i, n in enumerate(graph.nodes)}
    replacer = Replacer(graph)
    for batch in batches:
        forward = is_op(batch, annotations.unshard_all)
        tensors, calls = arg(batch, "tensors" if forward else "grads"), calls_of(arg(batch, "key"))
        for item in list(batch.users):
            if item.target is not operator.getitem:
                raise ValueError(f"autoshard backend: cannot split {batch.name} into one op per parameter: "
                                 f"{item.format_node()} uses it whole, not one output; run unbatch_annotations "
                                 "before any pass that changes how its outputs are read.")
            i = item.args[1]
            (op, rest), tensor = calls[i], tensors[i]
            if item.users:
                where = (graph.inserting_before(min(item.users, key=order.__getitem__)) if forward
                         else graph.inserting_after(_after(tensor)))
                with where:
                    single = graph.call_function(op, (tensor, *rest))
                single.meta.update(item.meta)  # the traced output's value (and stack) are the op's
                replacer.replace(item, single)
            else:
                replacer.erase(item)
        replacer.erase(batch)
    replacer.finish()
    graph.lint()
    gm.recompile()
    return gm
