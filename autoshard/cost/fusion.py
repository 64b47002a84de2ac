"""What a fusing compiler saves on a graph's memory-bound kernels: eager PyTorch against
``torch.compile``.

The simulator plays the unfused ATen graph, kernel by kernel, as eager PyTorch runs it: every
elementwise, norm, rotary, cast or reduction op reads its inputs from device memory and writes
its output back. Inductor fuses each connected run of such ops into one kernel (it does not fuse
across matmuls, attention or collectives), which reads the run's inputs once and writes only
what leaves the run. :func:`fusion_savings` prices a graph's fusible runs both ways on a
profile's roofline, so a compiled run's compute is its eager twin's less the difference.

It is the ideal fusion (one kernel per connected run): Inductor splits some runs (a reduction
and its consumers, ops of different iteration shapes), so the saving is an upper bound.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, NamedTuple

from torch import fx

from autoshard.cost.cost_model import DeviceProfile, get_profile, is_attention, node_flops, node_time
from autoshard.passes.graph_utils import collective_kind, is_view, is_wait, tensor_bytes


class Fusion(NamedTuple):
    """A graph's fusible ops: their seconds run one kernel each (``unfused``), as one kernel
    per connected run (``fused``), the runs, and the ops."""

    unfused: float
    fused: float
    kernels: int
    ops: int

    @property
    def saved(self) -> float:
        return self.unfused - self.fused


def module_path(node: fx.Node) -> str:
    """The module path a node came from, forward or backward (``""`` if unknown)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _fusible(node: fx.Node, within: Callable[[fx.Node], bool]) -> bool:
    if node.op != "call_function" or not hasattr(node.target, "overloadpacket"):
        return False
    if collective_kind(node) or is_wait(node) or is_attention(node) or node_flops(node):
        return False  # matmuls, attention and collectives stay their own kernels
    if any(key.startswith("autoshard") for key in node.meta):
        return False  # the sharding's own copies (gather copy-out, reduce copy-in): outside the compiled region
    return within(node)


def _runs(gm: fx.GraphModule, within: Callable[[fx.Node], bool]) -> tuple[list[list[fx.Node]], int]:
    """The connected runs of ``gm``'s fusible ops that ``within`` says the compiler sees (an
    edge between two fusible ops joins them), and how many ops they hold."""
    ops = [n for n in gm.graph.nodes if _fusible(n, within)]
    members = set(ops)
    parent = {n: n for n in ops}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in ops:
        for i in n.all_input_nodes:
            if i in members:
                parent[root(i)] = root(n)
    runs: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for n in ops:
        runs[root(n)].append(n)
    return list(runs.values()), len(ops)


def fusion_savings(gm: fx.GraphModule, profile: str | DeviceProfile,
                   within: Callable[[fx.Node], bool] = lambda node: True) -> Fusion:
    """The memory-bound ops of ``gm`` that ``within`` says the compiler sees, grouped into
    connected runs: each run priced as one kernel (a launch, plus the bytes of its distinct
    outside inputs and of its outputs used outside it, over the memory bandwidth) against its
    ops priced one kernel each (:func:`autoshard.cost.cost_model.node_time`)."""
    profile = get_profile(profile)
    runs, ops = _runs(gm, within)
    unfused = fused = 0.0
    kernels = 0
    for run in runs:
        inside = set(run)
        times = [node_time(n, profile) for n in run]
        unfused += sum(times)
        if not any(t > profile.op_overhead for t in times):
            fused += sum(times)  # views only: no kernel either way
            continue
        inputs = {i for n in run for i in n.all_input_nodes if i not in inside}
        outputs = [n for n in run if not is_view(n, hidden=True) and any(u not in inside for u in n.users)]
        nbytes = sum(tensor_bytes(i.meta.get("val")) for i in inputs) + sum(tensor_bytes(n.meta.get("val")) for n in outputs)
        fused += len(run) * profile.op_overhead + profile.launch_overhead + nbytes / profile.mem_bandwidth
        kernels += 1
    return Fusion(unfused, fused, kernels, ops)


def unmaterialized(gm: fx.GraphModule, within: Callable[[fx.Node], bool] = lambda node: True) -> set[fx.Node]:
    """The ops of ``gm``'s fusible runs whose values a fused kernel never writes to memory: no
    user outside their run reads them, nor a view of them (a view that leaves the run keeps
    the storage it aliases). Ideal fusion, as :func:`fusion_savings` prices it: an upper bound
    on what the compiler keeps in registers."""
    hidden: set[fx.Node] = set()
    for run in _runs(gm, within)[0]:
        inside = set(run)
        leaving = [n for n in run if any(u not in inside for u in n.users)]
        kept = set()
        while leaving:
            n = leaving.pop()
            if n not in kept:
                kept.add(n)
                if is_view(n, hidden=True):  # it aliases its first input: that storage leaves too
                    leaving += [i for i in n.all_input_nodes[:1] if i in inside]
        hidden |= inside - kept
    return hidden
