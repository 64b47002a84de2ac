"""Make sure every rank compiled the same communication plan, or fail loudly on all of them.

Ranks that disagree on which collectives to issue, or in which order, hang inside the first
mismatched collective. Passes decide only from graph structure, shapes and the cost model,
but a rank-dependent model or input can still split them; this check turns the hang into an
error raised on every rank.
"""
from __future__ import annotations

import hashlib
import itertools
from datetime import timedelta

import torch.distributed as dist
from torch import fx

from ._compat import c10d, default_store, resolve_process_group

# Every rank numbers its exchanges alike: they follow the order in which graphs are compiled.
_exchanges = itertools.count()
EXCHANGE_TIMEOUT = timedelta(minutes=5)

_COLLECTIVES = {
    c10d.all_gather_into_tensor.default,
    c10d.all_gather_into_tensor_out.default,  # PyTorch's bucketer (schedule "inductor")
    c10d.reduce_scatter_tensor.default,
    c10d.all_reduce.default,
}


def _group_shape(group_name: str) -> object:
    """A group as every rank of a mesh dimension sees it alike: its ranks relative to the
    lowest. Ranks in different rows of a 2-D mesh use different groups (and DeviceMesh names
    them differently on each), but groups of the same dimension have the same shape."""
    try:
        ranks = sorted(dist.get_process_group_ranks(resolve_process_group(group_name)))
    except (RuntimeError, ValueError):  # a group this process does not know: keep the name
        return group_name
    return tuple(r - ranks[0] for r in ranks)


def plan_signature(gm: fx.GraphModule) -> str:
    """A hash of the graph's communication plan: its collectives and waits in order, with the
    shapes, dtypes, groups (by shape, see :func:`_group_shape`) and parameters they move.
    Rank-independent by construction (shards are padded to equal sizes before any collective)."""
    events, index = [], {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _COLLECTIVES:
            index[node] = len(index)
            t = node.args[0].meta["val"]
            *args, group = node.args[1:]  # every collective here takes its group name last
            args.append(_group_shape(group))
            events.append((str(node.target), tuple(t.shape), str(t.dtype), tuple(args), node.meta.get("autoshard_params")))
        elif node.target is c10d.wait_tensor.default and node.args[0] in index:
            events.append(("wait", index[node.args[0]]))
    return hashlib.sha256(repr(events).encode()).hexdigest()[:16]


def check_ranks_agree(gm: fx.GraphModule, what: str) -> None:
    """Exchange the plan signature with every rank; raise the same error on all if any differ.

    The exchange goes through the process group's key-value store, not a collective: it runs
    inside the compiler, and a store lookup cannot interleave with the graph's collectives.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"autoshard/plan/{next(_exchanges)}"
    store = default_store()
    store.set(f"{key}/{rank}", plan_signature(gm))
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        store.wait(keys, EXCHANGE_TIMEOUT)
    except RuntimeError as e:
        raise RuntimeError(
            f"autoshard: not every rank compiled a {what} graph within {EXCHANGE_TIMEOUT}; ranks are compiling "
            "different graphs (a graph break or recompilation on some ranks only?). Make every rank run the same "
            "model code with the same shapes and options."
        ) from e
    signatures = [store.get(k).decode() for k in keys]
    if len(set(signatures)) > 1:
        groups: dict[str, list[int]] = {}
        for r, sig in enumerate(signatures):
            groups.setdefault(sig, []).append(r)
        detail = "; ".join(f"ranks {ranks}: {sig}" for sig, ranks in sorted(groups.items(), key=lambda kv: kv[1]))
        raise RuntimeError(
            f"autoshard: ranks compiled different communication plans for the {what} graph ({detail}). "
            "Running it would hang. Make every rank run the same model code with the same shapes and options "
            "(per-rank branches or per-rank input shapes split the plan)."
        )
