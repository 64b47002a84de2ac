"""Time each collective's wait, for ``autoshard.Telemetry`` (backend option ``telemetry``)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import fx

import autoshard.runtime.timed_waits  # noqa: F401  (registers autoshard::timed_wait)

from .graph_utils import is_wait

TIMED_WAIT = torch.ops.autoshard.timed_wait.default


def time_waits(gm: fx.GraphModule, describe: Callable[[fx.Node], Any]) -> fx.GraphModule:
    """Put an ``autoshard::timed_wait(t, kind, nbytes)`` right before each wait of a collective,
    on the tensor the wait waits for: it waits (timed) and records the kind and the bytes, so
    the graph's own wait then returns at once.

    ``describe(collective)``: the collective's kind and full-buffer bytes (``kind``, ``nbytes``:
    the cost model's ``collective_of``), or None for what is not one of ours.

    Before:  ag = all_gather_into_tensor(shard, ...);  w = wait_tensor(ag);  mm(w, x)
    After:   ag = all_gather_into_tensor(shard, ...);  timed_wait(ag, "all_gather", n);
             w = wait_tensor(ag);  mm(w, x)

    Guarantees: nothing else moves; every wait whose input comes from a collective ``describe``
    knows gets exactly one timed wait, in front of it, on the same tensor (declared as writing
    it, so no compiler runs the wait or a reader before it).
    """
    graph = gm.graph
    for wait in [n for n in graph.nodes if is_wait(n)]:
        waited = wait.args[0]
        if not isinstance(waited, fx.Node):
            continue
        found = describe(waited)
        if found is None:
            continue
        with graph.inserting_before(wait):
            graph.call_function(TIMED_WAIT, (waited, found.kind, int(found.nbytes)))
    graph.lint()
    gm.recompile()
    return gm
