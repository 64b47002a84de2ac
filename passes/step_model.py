"""What an order of one forward or backward graph costs: its peak live bytes and its time.

The scheduling pass compares candidate orders with these two numbers, so they are cheap
(one scan of the order) and see only the graph: bytes held outside it (optimizer state)
are the caller's to add. ``autoshard.cost.simulator`` plays the forward and backward
together, with the cost model's overlap and slowdown, for reports.

Which storage each node uses is walked here once (:func:`_rooted`), under the model's rule
(:class:`Storages`) and the rule the gloo and keep passes free and keep by (:func:`storage_roots`).
"""
from __future__ import annotations

import bisect
import operator
from typing import Any, Callable, Collection, Iterable, Sequence

from torch import fx

from autoshard._compat import c10d, schema_of

from .graph_utils import (
    COPY_OUT,
    PADS,
    collective_kind,
    is_view,
    is_wait,
    nbytes,
    out_buffer,
    taken_from_copy_out,
    tensor_bytes,
)
from .schedule_config import ScheduleConfig, Workspace, never, no_workspace  # noqa: F401  (re-exported)


def reads_input_until_wait(collective: fx.Node, input_copied: Callable[[fx.Node], bool] = never) -> bool:
    """Whether ``collective`` still reads its input after the issue. Not an out-of-place
    all-reduce (it reduces a clone made at the issue), nor a collective whose backend copies
    its input (``input_copied``: gloo's reduce-scatter)."""
    return collective.target is not c10d.all_reduce.default and not input_copied(collective)


def _views(node: fx.Node) -> bool:
    return is_view(node, hidden=True) or is_wait(node) or (node.op == "call_function" and node.target in PADS)


def _separate_outputs(node: fx.Node) -> bool:
    """Whether ``node`` returns several new tensors, each taken out with getitem and freed after
    its own last use, as eager frees them (and the simulator plays them): a multi-output op
    (native_layer_norm_backward, flash attention) or a bucket's copy-out. Not a view's parts
    (split), a collective's (its input, workspace and wait are priced on the collective), nor
    a tuple read whole by anything but getitem."""
    return (
        node.op == "call_function"
        and (node.target is COPY_OUT or isinstance(node.meta.get("val"), (list, tuple)))
        and collective_kind(node) is None
        and out_buffer(node) is None
        and not _views(node)
        and all(u.op == "call_function" and u.target is operator.getitem for u in node.users)
    )


def _taken_apart(node: fx.Node) -> bool:
    """One output taken out of a node with :func:`_separate_outputs`: a storage of its own."""
    return (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and _separate_outputs(node.args[0]))


def _aliases(node: fx.Node) -> bool:
    # Nodes that return (part of) an existing storage instead of allocating one. A pad counts
    # as one too, sized as its output: it pads zero rows where a rank's shard is full and more
    # where it is short, and every rank must price the graph alike (they must reach one plan).
    if taken_from_copy_out(node) or _taken_apart(node):  # a copy-out's or a multi-output op's parts are new tensors
        return False
    return (
        is_view(node, hidden=True)
        or is_wait(node)
        or (node.op == "call_function" and node.target in (operator.getitem, *PADS))
    )


def linger(issues: Sequence[int], at: int) -> int:
    """Where buffers freed at position ``at`` are gone under gloo's late frees: at the next
    collective issued after ``at`` (``issues``: issue positions, sorted), else at ``at``."""
    later = bisect.bisect_right(issues, at)
    return issues[later] if later < len(issues) else at


def release_points(order: Sequence[fx.Node], late: Collection[str] = ()) -> dict[fx.Node, int]:
    """Collective -> the position up to which its input and workspace stay allocated: its
    wait, or for the collective kinds in ``late`` the next collective issued after it (gloo
    drops a finished reduction's copy of its input on its own thread, which may be after the
    wait has returned; the next issue is as long as this model lets it linger)."""
    release = PeakModel(order, late_release=late).release(list(range(len(order))), len(order))
    return {order[c]: at for c, at in release.items()}


def _rooted(nodes: Iterable[fx.Node], base_of: Callable[[fx.Node], fx.Node | None]) -> dict[fx.Node, fx.Node]:
    """node -> the node that allocated the storage it uses (itself when it allocates), walking
    ``nodes`` in a topological order, a base rooted before its aliases: the one walker of
    storage aliases. ``base_of(node)``: the node whose storage ``node`` returns, None when it
    allocates. Its two rules (:class:`Storages`' and :func:`storage_roots`') and the
    simulator's (``autoshard.cost.liveness.Liveness``) agree on every stage the passes
    see (tests/test_models_agree.py)."""
    root: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        base = base_of(n)
        root[n] = root.get(base, base) if base is not None else n
    return root


def _returns_its_input(node: fx.Node) -> bool:
    # An in-place op (copy_ into a slice of a bucket, as PyTorch's bucketer does) returns its
    # first argument: its schema's return shares that argument's alias set.
    schema = schema_of(node.target)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def storage_roots(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """node -> the node that allocated the storage it uses (itself when it allocates): what the
    liveness of the gloo buffers (passes/gloo.py) and of the kept blocks (passes/keep.py) reads.
    Views, waits and in-place ops return an existing storage, and so does a piece of a view
    (getitem of split); every getitem is a storage of its own here, as :class:`Storages` takes
    a multi-output op's outputs."""

    def base_of(n: fx.Node) -> fx.Node | None:
        base = out_buffer(n)
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if base is None and first is not None and (
            is_view(n, hidden=True) or is_wait(n) or _returns_its_input(n)
            or (n.target is operator.getitem and is_view(first, hidden=True))  # a piece of split(...)
        ):
            base = first
        return base

    return _rooted(graph.nodes, base_of)


class Storages:
    """Which storage each node of a graph uses and how large each is: the part of
    :func:`peak_bytes` that no order changes, computed once for a search over many orders.
    A node returning several new tensors (a multi-output op such as native_layer_norm_backward
    or flash attention, a bucket's copy-out; :func:`_separate_outputs`) is not one storage:
    each output taken out of it with getitem is a storage of its own, freed after its own last
    use; the node itself holds the outputs nothing takes (0 bytes for a copy-out), until its
    last getitem."""

    def __init__(self, nodes: Sequence[fx.Node]) -> None:
        taken: dict[tuple[fx.Node, Any], fx.Node] = {}  # (multi-output node, index) -> its first getitem

        def base_of(n: fx.Node) -> fx.Node | None:
            if _taken_apart(n):  # a later getitem of the same output is the first one's alias
                first = taken.setdefault((n.args[0], n.args[1]), n)
                return first if first is not n else None
            return out_buffer(n) or (n.args[0] if n.args and isinstance(n.args[0], fx.Node) and _aliases(n) else None)

        self.root = _rooted(nodes, base_of)  # node -> the node whose storage it uses
        self.size: dict[fx.Node, int] = {}  # a storage's bytes: the largest of its aliases (a pad's output)
        for n in nodes:
            r = self.root[n]
            if n.op == "call_function" and n.target is COPY_OUT:
                own = 0  # its parts are all taken out
            else:
                own = _untaken_bytes(n) if _separate_outputs(n) else nbytes(n)
            self.size[r] = max(self.size.get(r, 0), own)


def _untaken_bytes(node: fx.Node) -> int:
    """Bytes of the outputs of a multi-output node that no getitem takes out (an unused
    ``rstd``): allocated with the node, freed after its last getitem, as the simulator plays them."""
    taken = {u.args[1] for u in node.users}
    return sum(tensor_bytes(v) for i, v in enumerate(node.meta["val"]) if i not in taken)


def peak_bytes(order: Sequence[fx.Node], workspace: Workspace = no_workspace, **options: Any) -> tuple[int, int]:
    """(peak live bytes, position of the peak) of the graph run in ``order``; ``workspace``
    and ``options`` as :class:`PeakModel` takes them."""
    return PeakModel(order, workspace, **options).peak(list(range(len(order))))


class PeakModel:
    """The peak live bytes of many orders of the same nodes (a schedule search; one order:
    :func:`peak_bytes`): what no order changes (storages, sizes, inputs, waits, workspaces) is
    read once, as indices into ``nodes``; :meth:`peak` takes an order as a permutation of them.

    A storage is allocated when its node runs and freed after the last use of it or of any
    alias (views, getitem, waits alias their input); a collective's input also lives until
    its wait (the comm stream reads it) unless :func:`reads_input_until_wait` says it is done
    with it at the issue, and its ``workspace`` from issue to wait. Graph
    outputs live to the end. ``pin_inputs``: placeholders live to the end too, as a forward's
    do (they belong to the caller: parameter shards, the batch); a backward's (saved
    activations, tangents) are freed after their last use (False), since the backend runs
    graphs in the boxed convention, which hands the inputs over (``_compat.boxed``). ``held_outside``: placeholders the
    caller counts itself (a backward's parameter shards), here 0 bytes. ``late_release``:
    the kinds of collective whose inputs and workspaces last until :func:`release_points` says.
    ``output_at_wait``: the kinds of collective whose result is made at the wait (a reduction
    the graph runs in place and then copies its chunk from, passes/gloo.py), not at the issue.
    ``storages``: :class:`Storages` of these nodes, when the caller prices many orders of them.
    """

    def __init__(
        self,
        nodes: Sequence[fx.Node],
        workspace: Workspace = no_workspace,
        pin_inputs: bool = True,
        held_outside: Collection[fx.Node] = (),
        late_release: Collection[str] = (),
        input_copied: Callable[[fx.Node], bool] = never,
        output_at_wait: Collection[str] = (),
        storages: Storages | None = None,
    ) -> None:
        self.nodes = list(nodes)
        index = {n: i for i, n in enumerate(self.nodes)}
        found = storages or Storages(self.nodes)
        root = [index.get(found.root[n], -1) for n in self.nodes]
        rooted = lambda a: root[index[a]] if a in index else -1  # noqa: E731  inputs elsewhere never free anything here
        self.inputs = [[r for r in map(rooted, n.all_input_nodes) if r >= 0] for n in self.nodes]
        self.collectives = [i for i, n in enumerate(self.nodes) if collective_kind(n) is not None]
        self.wait = {c: next((index[u] for u in self.nodes[c].users if is_wait(u) and u in index), -1) for c in self.collectives}
        self.late = {c for c in self.collectives if collective_kind(self.nodes[c]) in late_release}
        self.reads = [c for c in self.collectives if reads_input_until_wait(self.nodes[c], input_copied)]
        # Each storage: (node index, bytes, pinned to the end, made at its collective's wait).
        self.storages = []
        for i, n in enumerate(self.nodes):
            size = 0 if n in held_outside else found.size[n] if root[i] == i else 0
            if size:
                at_wait = collective_kind(n) in output_at_wait and self.wait.get(i, -1) >= 0
                self.storages.append((i, size, n.op == "placeholder" and pin_inputs, at_wait))
        # A collective's workspace counts where its own storage does.
        counted = {i for i, *_ in self.storages}
        self.workspace = [(c, extra) for c in self.collectives if c in counted and (extra := workspace(self.nodes[c]))]
        output = self.nodes[0].graph.output_node() if self.nodes else None
        self.live_to_end = [r for r in map(rooted, output.all_input_nodes) if r >= 0] if output is not None else []

    def release(self, pos: Sequence[int], end: int) -> dict[int, int]:
        """Collective index -> where its input and workspace are released (see
        :func:`release_points`), each node at ``pos[index]`` of an order of ``end`` nodes."""
        issues = sorted(pos[c] for c in self.collectives)
        release = {}
        for c in self.collectives:
            w = self.wait[c]
            at = pos[w] if w >= 0 else end
            release[c] = linger(issues, at) if c in self.late and w >= 0 else at
        return release

    def peak(self, order: Sequence[int]) -> tuple[int, int]:
        """(peak live bytes, position of the peak in ``order``)."""
        end = len(order)
        pos = [0] * len(self.nodes)
        for p, i in enumerate(order):
            pos[i] = p
        release = self.release(pos, end)
        last = [-1] * len(self.nodes)
        for i, inputs in enumerate(self.inputs):
            p = pos[i]
            for r in inputs:
                if last[r] < p:
                    last[r] = p
        for c in self.reads:  # the collective's input, read until the wait (or later)
            at = release[c]
            for r in self.inputs[c]:
                if last[r] < at:
                    last[r] = at
        for r in self.live_to_end:
            last[r] = end
        delta = [0] * (end + 1)
        for i, size, pinned, at_wait in self.storages:
            free = end if pinned else (last[i] if last[i] >= 0 else pos[i])
            delta[pos[self.wait[i]] if at_wait else pos[i]] += size
            delta[min(free + 1, end)] -= size
        for c, extra in self.workspace:
            delta[pos[c]] += extra
            delta[min(release[c] + 1, end)] -= extra
        live = peak = at = 0
        for i in range(end):
            live += delta[i]
            if live > peak:
                peak, at = live, i
        return peak, at


def step_time(order: Sequence[fx.Node], config: ScheduleConfig) -> float:
    """Seconds to run ``order``: compute nodes one after another (``config.compute_time``);
    collectives one after another on a comm stream (``config.comm_time``), each starting once
    issued and the previous one ended; a wait holds compute until its collective ends. While a
    collective runs it takes :meth:`ProfileFigures.caller_cost` of its time from compute (the
    profile's ``comm_overlap`` and ``comm_issue_cost``, as the simulator plays them: on CPU
    ranks gloo's threads take cycles from it)."""
    return TimeModel(order, config).time(list(range(len(order))))


class TimeModel:
    """:func:`step_time` of many orders of the same nodes: each node's time is priced once;
    :meth:`time` takes an order as a permutation of indices into ``nodes``."""

    def __init__(self, nodes: Sequence[fx.Node], config: ScheduleConfig) -> None:
        index = {n: i for i, n in enumerate(nodes)}
        figures = config.figures
        # Per node: (COMM, duration, the caller's share) | (WAIT, its collective's index or -1) | (COMPUTE, seconds).
        self.steps: list[tuple] = []
        for n in nodes:
            if collective_kind(n) is not None:
                duration = config.comm_time(n)
                self.steps.append((_COMM, duration, figures.caller_cost(duration)))
            elif is_wait(n):
                self.steps.append((_WAIT, index.get(n.args[0], -1)))
            else:
                self.steps.append((_COMPUTE, config.compute_time(n)))

    def time(self, order: Sequence[int]) -> float:
        now = comm = 0.0
        ends: dict[int, float] = {}
        steps = self.steps
        for i in order:
            step = steps[i]
            if step[0] == _COMPUTE:
                now += step[1]
            elif step[0] == _COMM:
                comm = max(comm, now) + step[1]
                ends[i] = comm
                now += step[2]
            else:
                now = max(now, ends.get(step[1], now))
        return now


_COMPUTE, _COMM, _WAIT = range(3)
