"""Make sure every rank compiled the same communication plan, or fail loudly on all of them.

Ranks that disagree on which collectives to issue, or in which order, hang inside the first
mismatched collective. Passes decide only from graph structure, shapes and the cost model,
but a rank-dependent model or input can still split them; this check turns the hang into an
error raised on every rank.
"""
from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import hashlib
import itertools
import pickle
import time
from datetime import timedelta
from typing import Callable, Iterator, TypeVar

import torch.distributed as dist
from torch import fx

from autoshard._compat import default_store
from autoshard.passes.graph_utils import collective_kind, group_ranks, is_wait, tensors, val
from autoshard.runtime.errors import PlanMismatchError, RankFailedError
from autoshard.runtime.fail_together import first_failure, multi_rank, recorded_failure

# Every rank numbers its exchanges alike: they follow the order in which graphs are compiled.
_exchanges = itertools.count()
EXCHANGE_TIMEOUT = timedelta(minutes=5)
# Where a rank that failed compiling says so: its peers stop waiting for its plan at once.
_COMPILE_FAILED = "autoshard/compile_failed"
# Errors the backend compiles again on (retried_when): a step raising one records no failure.
_retried: contextvars.ContextVar[Callable[[BaseException], bool]] = contextvars.ContextVar(
    "autoshard_retried", default=lambda error: False)
F = TypeVar("F", bound=Callable)
T = TypeVar("T")


def reports_compile_failure(compile_step: F) -> F:
    """Decorate a compile step that runs before the plan exchange: if it raises on one rank,
    record the error, so ranks waiting for that rank's plan raise now, not after
    ``EXCHANGE_TIMEOUT``; unless the compile will be retried on it (:func:`retried_when`)."""

    @functools.wraps(compile_step)
    def step(*args, **kwargs):
        try:
            return compile_step(*args, **kwargs)
        except BaseException as error:
            if multi_rank() and not _retried.get()(error):  # records only the first rank's error
                first_failure(_COMPILE_FAILED, dist.get_rank(), error)
            raise

    return step  # type: ignore[return-value]


@contextlib.contextmanager
def retried_when(retried: Callable[[BaseException], bool]) -> Iterator[None]:
    """Inside, an error for which ``retried`` is true is not recorded as the compile's failure:
    the backend compiles again. Only for errors every rank raises alike, at the same step
    (a decision made from shapes and the cost model), so no peer is left waiting for a plan."""
    token = _retried.set(retried)
    try:
        yield
    finally:
        _retried.reset(token)


def _wait_for_plans(keys: list[str], what: str) -> None:
    """Wait until every rank published its plan, a rank failed compiling, or the timeout."""
    store = default_store()
    deadline, pause = time.monotonic() + EXCHANGE_TIMEOUT.total_seconds(), 0.01
    while not store.check(keys):
        if (failure := recorded_failure(_COMPILE_FAILED)) is not None:
            failed, message = failure
            raise RankFailedError(f"autoshard backend: rank {failed} failed compiling ({message}); rank {dist.get_rank()} stops "
                               f"too instead of waiting for its {what} plan; fix the error rank {failed} raised (its own "
                               "traceback shows where).")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"autoshard backend: not every rank compiled a {what} graph within {EXCHANGE_TIMEOUT}; ranks are compiling "
                "different graphs (a graph break or recompilation on some ranks only?); make every rank run the same "
                "model code with the same shapes and options."
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.5)



def _group_shape(group_name: str) -> object:
    """A group as every rank of a mesh dimension sees it alike: its ranks relative to the
    lowest. Ranks in different rows of a 2-D mesh use different groups (and DeviceMesh names
    them differently on each), but groups of the same dimension have the same shape."""
    ranks = group_ranks(group_name)
    if ranks is None:  # a group this process does not know: keep the name
        return group_name
    ranks = sorted(ranks)
    return tuple(r - ranks[0] for r in ranks)


def plan_events(gm: fx.GraphModule) -> list[tuple]:
    """The graph's communication plan: its collectives and waits in order, with the shapes,
    dtypes, groups (by shape, see :func:`_group_shape`) and parameters they move.
    Rank-independent by construction (shards are padded to equal sizes before any collective)."""
    events, index = [], {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if collective_kind(node) is not None:
            index[node] = len(index)
            moved = [(tuple(t.shape), str(t.dtype)) for t in tensors(fx.node.map_aggregate(node.args[0], val))]
            *args, group = node.args[1:]  # every collective takes its group name last
            args.append(_group_shape(group))
            events.append((str(node.target), tuple(moved), tuple(args), node.meta.get("autoshard_params")))
        elif is_wait(node) and node.args[0] in index:
            events.append(("wait", index[node.args[0]]))
    return events


def plan_signature(gm: fx.GraphModule) -> str:
    """A hash of :func:`plan_events`."""
    return _signature(plan_events(gm))


def _signature(events: list[tuple]) -> str:
    return hashlib.sha256(repr(events).encode()).hexdigest()[:16]


def _describe(event: tuple | None) -> str:
    if event is None:
        return "nothing (its plan ends there)"
    if event[0] == "wait":
        return f"the wait of collective #{event[1]}"
    target, moved, _, params = event
    kind = target.split(".")[-2] if "." in target else target
    shapes = ", ".join(f"{list(shape)} {dtype.removeprefix('torch.')}" for shape, dtype in moved)
    names = ", ".join(params[:3]) + (f" and {len(params) - 3} more" if len(params) > 3 else "") if params else "?"
    return f"{kind} of {shapes} moving {names}"


def first_difference(plans: dict[int, list[tuple]]) -> str:
    """Where ranks' plans (rank -> :func:`plan_events`) first differ, in words: the position
    and, per distinct event there, what it is and which ranks have it."""
    longest = max(map(len, plans.values()))
    for i in range(longest):
        at: dict[str, list[int]] = {}
        for rank, events in sorted(plans.items()):
            at.setdefault(_describe(events[i] if i < len(events) else None), []).append(rank)
        if len(at) > 1:
            return f"event {i} of the plan: " + "; ".join(f"ranks {ranks} have {what}" for what, ranks in at.items())
    return "the plans hold the same events"


def rank0s(decision: T, what: str) -> T:
    """Rank 0's ``decision`` on every rank (every rank calls this, in the same order).

    The passes decide from shapes and the cost model; ranks given different numbers of samples
    (batch shares) see different activation sizes and compute times, and would bucket and
    order their collectives differently. Taking one rank's decisions for the graph every rank
    has (same structure, different batch) keeps their plans equal. Exchanged through the
    store, as the plans are.
    """
    if not multi_rank():
        return decision
    key = f"autoshard/decision/{next(_exchanges)}"
    store = default_store()
    if dist.get_rank() == 0:
        store.set(key, pickle.dumps(decision))
    _wait_for_plans([key], what)
    return pickle.loads(store.get(key))


def check_ranks_agree(gm: fx.GraphModule, what: str) -> None:
    """Exchange the plan signature with every rank; raise the same error on all if any differ.

    The exchange goes through the process group's key-value store, not a collective: it runs
    inside the compiler, and a store lookup cannot interleave with the graph's collectives.
    """
    if not multi_rank():
        return
    # The events themselves, not only their hash: a mismatch names what differs.
    texts = _exchange(repr(plan_events(gm)), what)
    if len(set(texts)) > 1:
        plans = {r: ast.literal_eval(text) for r, text in enumerate(texts)}
        groups: dict[str, list[int]] = {}
        for r, events in plans.items():
            groups.setdefault(_signature(events), []).append(r)
        detail = "; ".join(f"ranks {ranks}: {sig}" for sig, ranks in sorted(groups.items(), key=lambda kv: kv[1]))
        raise PlanMismatchError(
            f"autoshard backend: ranks compiled different communication plans for the {what} graph ({detail}), "
            f"and running it would hang. First difference: {first_difference(plans)}. A per-rank branch or per-rank "
            "input shapes in the model split the plan: make every rank run the same code with the same shapes and "
            "options. If they already do, this is an autoshard bug: please report it with this message."
        )


def _exchange(text: str, what: str) -> list[str]:
    """Every rank's ``text`` (rank order), through the store; every rank calls it alike."""
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"autoshard/plan/{next(_exchanges)}"
    store = default_store()
    store.set(f"{key}/{rank}", text)
    keys = [f"{key}/{r}" for r in range(world)]
    _wait_for_plans(keys, what)
    return [store.get(k).decode() for k in keys]


def keys_agree(key: str, what: str) -> bool:
    """Before a compile the caches may serve: exchange its cache key (the Dynamo graph, its
    input shapes and every input of the plan, compiler/cache_key.py) with every rank. True
    when all are equal: then the plan is equal too, whether a rank's compile hits the cache
    (and runs no passes) or misses, so the plan exchange is not needed. False on every rank
    when any differ (ranks with their own batch shares see other input shapes): the compile
    then runs uncached on every rank, and the passes exchange their decisions and plans
    (:func:`rank0s`, :func:`check_ranks_agree`), which also name a real mismatch."""
    return not multi_rank() or len(set(_exchange(key, what))) == 1
