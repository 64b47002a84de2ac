"""All-gathers into a buffer over gloo: the one form of all-gather it runs safely in flight."""
from __future__ import annotations

from typing import Callable

import torch
from torch import fx

from autoshard._compat import c10d

from .graph_utils import arg, collectives, group_backend, val

aten = torch.ops.aten

# gloo runs the out-of-place all_gather_into_tensor through its coalesced all-gather work,
# which corrupts the process's heap when several gathers are in flight at once (measured on
# torch 2.11, 2.13 and 2.15, two gloo ranks: four in flight abort in malloc within 20 s; one,
# two or three at a time, and reduce-scatters or all-reduces four at a time, survive 20000
# rounds). The _out form runs gloo's plain all-gather work, which survived 20000 rounds of
# four and of eight in flight. It is the form PyTorch's own bucketer emits, so Inductor lowers
# it too. Other backends keep the out-of-place op, which they run without this.


def on_gloo(group_name: str) -> bool:
    return group_backend(group_name) == "gloo"


def gathers_into_buffers(gm: fx.GraphModule, needed: Callable[[str], bool] = on_gloo) -> fx.GraphModule:
    """Rewrite each all-gather over a gloo group into an all-gather into a fresh buffer.

    Guarantees: every ``all_gather_into_tensor(x, n, group)`` with ``needed(group)`` (default:
    the group's backend is gloo) becomes
    ``empty(result shape) -> all_gather_into_tensor_out(x, n, group, out=buffer)`` at the same
    place, keeping the node's meta (its parameters, its value); its wait and every use are
    unchanged, so order, numerics and collectives are too. Other groups' gathers are
    untouched; the pass is idempotent.

        before:  x -> all_gather_into_tensor(x) -> wait_tensor -> uses
        after:   x, empty -> all_gather_into_tensor_out(x, out=empty) -> wait_tensor -> uses
    """
    graph = gm.graph
    changed = False
    for gather in collectives(graph, c10d.all_gather_into_tensor.default):
        value = val(gather)
        if not isinstance(value, torch.Tensor) or not needed(arg(gather, "group_name")):
            continue
        with graph.inserting_before(gather):
            buffer = graph.call_function(
                aten.empty.memory_format, (list(value.shape),), {"dtype": value.dtype, "device": value.device}
            )
            into = graph.call_function(c10d.all_gather_into_tensor_out.default, gather.args, {"out": buffer})
        buffer.meta["val"] = value  # the buffer is the result: the _out op returns it
        into.meta.update(gather.meta)
        gather.replace_all_uses_with(into)
        graph.erase_node(gather)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
