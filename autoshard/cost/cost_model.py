"""A first cost model: roofline for compute nodes, ring alpha-beta for collectives.

Works on the final (post-partition) ATen FX graphs, whose nodes carry FakeTensors (or meta
tensors) in ``node.meta["val"]``. Estimates are for one rank, in seconds; they are meant to rank
schedules and buckets against each other, not to predict wall-clock time to the percent.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Collection, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import fx
from torch.utils.flop_counter import flop_registry

from autoshard._compat import c10d, optimization_hint

# The profiles live in profiles.py; callers read them from here too.
from autoshard.cost.profiles import (  # noqa: F401
    GLOO_INPUT_COPIED,
    GLOO_RELEASE_LATE,
    GLOO_WORKSPACE,
    PROFILES,
    DeviceProfile,
    Link,
    uniform_link,
)
from autoshard.passes.graph_utils import (
    COLLECTIVE_KINDS,
    arg,
    collective_kind,
    group_ranks,
    is_exchange,
    is_view,
    is_wait,
    tensor_bytes,
    tensors,
)
from autoshard.passes.schedule_config import CollectiveMemory, ScheduleConfig
from autoshard.runtime.errors import UsageError
from autoshard.runtime.expert_ops import EXPERT_PARALLEL, EXPERT_PARALLEL_BACKWARD
from autoshard.runtime.ops import arguments

aten = torch.ops.aten





def get_profile(name: str | DeviceProfile) -> DeviceProfile:
    """The profile called ``name``, or read from ``name`` if it is a ``.json`` file (as
    ``python -m autoshard calibrate`` writes one), or ``name`` itself if it is a profile."""
    if isinstance(name, DeviceProfile):
        return name
    if name in PROFILES:
        return PROFILES[name]
    if str(name).endswith(".json"):
        try:
            return DeviceProfile.from_json(Path(name).read_text())
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise UsageError(
                f"cannot read device profile {name!r}: {e}; write one with `autoshard calibrate --out {name}`."
            ) from None
    raise UsageError(f"unknown device profile {name!r}; use one of {sorted(PROFILES)} or a .json profile file.")


# The CPU attention kernels that the flop counter's registry lacks, with the formulas of
# their CUDA counterparts (same leading q, k, v / grad_out, q, k, v arguments).
_EXTRA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ],
}


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg



def node_flops(node: fx.Node) -> int:
    """FLOPs of one call, by ``torch.utils.flop_counter``'s formulas on the fake values.

    Ops without a formula (elementwise, reductions, copies) count 0: the roofline makes
    them memory-bound, which they are.
    """
    packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None
    formula = flop_registry.get(packet) or _EXTRA_FLOP_FORMULAS.get(packet)
    if formula is None:
        return 0
    args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), _val)
    flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
    # A symbolic count's hint, without adding guards; unbacked counts as 1.
    return optimization_hint(flops, fallback=1) if isinstance(flops, torch.SymInt) else int(flops)


def _compute_dtype(node: fx.Node) -> torch.dtype:
    for inp in node.all_input_nodes:
        value = inp.meta.get("val")
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return torch.float32


# Ops that only allocate (a buffer a collective writes into): no kernel touches the bytes.
_ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)
# Ops that read only the part of their input they copy out (a bucket's copy-out): as many bytes as they write.
_READS_WHAT_IT_WRITES = (torch.ops.aten.narrow_copy.default,)


# (kernels launched, row buffers copied) by one expert-parallel call, forward and backward: the
# routing (sort, counts), the row gathers and scatters, the experts' matmuls and activation
# (their autograd's in backward); what autoshard/runtime/expert_ops.py runs, counted by hand.
_EXPERT_KERNELS = {False: (8, 4), True: (16, 8)}


class ExpertExchanges(NamedTuple):
    """One ``autoshard::expert_parallel`` (or backward) call split as the simulator plays it:
    the local experts' compute, and its all-to-alls (seconds and full-buffer bytes each) over
    its group: the dispatch before the experts run, the combine after."""

    compute: float
    dispatch: tuple[float, int]
    combine: tuple[float, int]
    group: str
    ranks: tuple[int, ...]


def expert_parallel_parts(node: fx.Node, profile: str | DeviceProfile) -> ExpertExchanges:
    """:func:`expert_parallel_time`'s terms: the local experts' matmuls on the tokens routed
    to them (as many, on average, as this rank sends: ``T * k``) and the all-to-alls of
    ``T * k`` token rows, each priced as a ring reduce-scatter of that buffer (``(n-1)``
    latencies, ``(n-1)/n`` of the bytes cross). Forward: dispatch and combine one row width
    each, the experts once. Backward: the dispatch carries tokens and output gradients (twice
    the width), the combine the input gradients, the experts recomputed and differentiated
    (3x the forward's FLOPs). Around them, the op's own kernels: a launch each
    (:data:`_EXPERT_KERNELS`) and its row copies at memory bandwidth (sorting rows by expert and
    back: 4 row buffers read or written in forward, 8 in backward), which a small model's step
    is made of as much as of the matmuls."""
    profile = get_profile(profile)
    found = arguments(node.target, node.args, node.kwargs)
    hidden, index = _val(found["hidden"]), _val(found["top_k_index"])
    weights = [_val(w) for w in found["weights"]]
    rows = index.shape[0] * index.shape[1]
    flops = 2 * rows * sum(w.numel() // w.shape[0] for w in weights)  # one expert's weights per routed row
    backward = node.target is EXPERT_PARALLEL_BACKWARD
    unit = rows * hidden.shape[1] * hidden.element_size()
    ranks = group_ranks(found["group_name"]) or tuple(range(found["world_size"]))

    def exchange(nbytes: int) -> tuple[float, int]:
        return collective_time("reduce_scatter", nbytes, ranks, profile), nbytes

    kernels, copies = _EXPERT_KERNELS[backward]
    compute = (profile.op_overhead + kernels * profile.launch_overhead + (3 if backward else 1) * flops / profile.flops_per_s(hidden.dtype)
               + copies * unit / profile.mem_bandwidth)
    return ExpertExchanges(compute, exchange((2 if backward else 1) * unit), exchange(unit), found["group_name"], ranks)


def expert_parallel_time(node: fx.Node, profile: str | DeviceProfile) -> float:
    """Seconds of one ``autoshard::expert_parallel`` (or its backward) call, its all-to-alls
    included (the op blocks the compute stream while they run): :func:`expert_parallel_parts`
    summed."""
    parts = expert_parallel_parts(node, profile)
    return parts.compute + parts.dispatch[0] + parts.combine[0]


def node_time(node: fx.Node, profile: str | DeviceProfile) -> float:
    """Seconds one compute node takes:
    ``op_overhead + launch_overhead + max(flops / peak, bytes / mem_bw)``.

    bytes = tensor input bytes + output bytes (a copy-out reading part of its input: twice its
    output bytes); peak is for the dtype of the first floating
    point input. Views, allocations (``empty``) and ATen calls producing no tensor (shape
    arithmetic) launch no kernel and cost only ``op_overhead``. Zero for placeholders, outputs, get_attr, getitem, anything
    that is not an ATen-style OpOverload, and every ``_c10d_functional`` op (costed by
    :func:`collective_time` instead).
    """
    if node.op != "call_function" or not hasattr(node.target, "overloadpacket") or collective_kind(node) or is_wait(node):
        return 0.0  # getitem, builtins, higher-order ops: no ATen call
    if node.target in (EXPERT_PARALLEL, EXPERT_PARALLEL_BACKWARD):
        return expert_parallel_time(node, profile)  # blocking: its all-to-alls are inside
    profile = get_profile(profile)
    if is_view(node, hidden=True) or node.target in _ALLOCATIONS or not tensors(node.meta.get("val")):
        return profile.op_overhead
    written = tensor_bytes(node.meta.get("val"))
    if node.target in _READS_WHAT_IT_WRITES:
        nbytes = 2 * written
    else:
        nbytes = written + sum(tensor_bytes(arg.meta.get("val")) for arg in _input_nodes(node))
    flop_time = _attention_time(node, profile)
    if flop_time is None:
        flop_time = node_flops(node) / profile.flops_per_s(_compute_dtype(node))
    return profile.op_overhead + profile.launch_overhead + max(flop_time, nbytes / profile.mem_bandwidth)


_ATTENTION = {getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
    if hasattr(aten, name)}


def is_attention(node: fx.Node) -> bool:
    """A fused attention kernel (SDPA's flash, efficient, cuDNN or CPU forms, and backwards)."""
    return node.op == "call_function" and node.target in _ATTENTION


def _attention_time(node: fx.Node, profile: DeviceProfile) -> float | None:
    """Seconds of a fused attention kernel's FLOPs where the profile prices attention apart
    (``attention_efficiency``); None otherwise. A causal kernel skips the masked half of the
    score square that the flop counter counts whole."""
    if profile.attention_efficiency is None or not is_attention(node):
        return None
    causal = arguments(node.target, node.args, node.kwargs).get("is_causal", False)
    peak = profile.peak_flops_per_s(_compute_dtype(node))
    return node_flops(node) * (0.5 if causal else 1.0) / (peak * profile.attention_efficiency)


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    # Unlike all_input_nodes, counts an input passed twice twice: the kernel reads it twice.
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


class Collective(NamedTuple):
    """What a collective node moves: its kind, its bytes as :func:`collective_time` counts
    them, its process group's name and the global ranks in that group."""

    kind: str
    nbytes: int
    group: str
    ranks: tuple[int, ...]


def _ring(link: Link, kind: str, steps: int, fraction: float, nbytes: int) -> float:
    return steps * link.latency[kind] + fraction * nbytes / link.bandwidth[kind]


def collective_time(kind: str, nbytes: int, ranks: int | Sequence[int], profile: str | DeviceProfile) -> float:
    """Seconds of one ring collective over ``ranks`` (global ranks, or a group size n meaning
    ranks 0..n-1), in the alpha-beta model behind nccl-tests' bus bandwidth.

    Convention: ``nbytes`` is the FULL buffer: the gathered output of an all-gather, the
    pre-reduce input of a reduce-scatter, the buffer of an all-reduce. all_gather /
    reduce_scatter take ``(n-1) * latency + (n-1)/n * nbytes / busbw``, all_reduce twice that.
    Within one node the intra link sets both terms. A group spanning k nodes is one ring whose
    k node crossings take the inter link's latency and whose bandwidth is the inter link's: the
    slowest hop paces a ring; on a profile with a NIC per rank (``nic_per_rank``) the g ranks
    of the group on each node cross in parallel, g NICs' bandwidth, unless forwarding (g-1)/g
    of the bytes over the intra link is slower. 0 for one rank.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; valid kinds are {COLLECTIVE_KINDS}.")
    ranks = range(ranks) if isinstance(ranks, int) else ranks
    n = len(ranks)
    if n <= 1:
        return 0.0
    profile = get_profile(profile)
    nodes = len({r // profile.ranks_per_node for r in ranks})
    fraction = (n - 1) / n
    if nodes == 1 or profile.inter is None:
        ring = _ring(profile.intra, kind, n - 1, fraction, nbytes)
    else:
        # With a NIC per rank, one ring channel per NIC: each of the g ranks a group has on a
        # node sends 1/g of the ring's bytes between nodes and forwards the rest over the
        # node's own link, both at once; else one inter link carries them all (g = 1).
        g = n // nodes if profile.nic_per_rank else 1
        if g == 1:
            ring = _ring(profile.intra, kind, n - nodes, 0.0, 0) + _ring(profile.inter, kind, nodes, fraction, nbytes)
        else:
            inter, intra = profile.inter.bandwidth[kind], profile.intra.bandwidth[kind]
            ring = (_ring(profile.intra, kind, n - nodes, 0.0, 0) + _ring(profile.inter, kind, nodes, 0.0, 0)
                    + fraction * nbytes * max(1 / (g * inter), (g - 1) / (g * intra)))
    return 2 * ring if kind == "all_reduce" else ring


def _group_size(node: fx.Node) -> int:
    if node.target is c10d.all_to_all_single.default:  # one chunk per rank
        return len(arg(node, "output_split_sizes"))
    return arg(node, "group_size")


def collective_of(node: fx.Node) -> Collective | None:
    """The :class:`Collective` a node runs; None for anything else (including wait_tensor).

    Recognises what :func:`autoshard.passes.graph_utils.collective_kind` does:
    ``_c10d_functional`` ``all_gather_into_tensor`` (and its ``_out`` form),
    ``reduce_scatter_tensor``, ``all_reduce`` and their ``_coalesced`` forms (one collective
    over all their buffers). A group this process does not know (a graph compiled elsewhere)
    counts as ranks 0..size-1 (the op's group size, else the world's).
    """
    kind = collective_kind(node)
    if kind is None:
        return None
    group = arg(node, "group_name")
    # The full buffer: a gather's output, a reduction's input (its first argument).
    nbytes = tensor_bytes(node.meta.get("val") if kind == "all_gather" else fx.node.map_aggregate(node.args[0], _val))
    ranks = group_ranks(group)
    if ranks is None:
        size = None if kind == "all_reduce" else _group_size(node)
        ranks = tuple(range(size or (dist.get_world_size() if dist.is_initialized() else 1)))
    return Collective(kind, nbytes, group, ranks)


def estimators(profile: str | DeviceProfile) -> tuple[Callable[[fx.Node], float], Callable[..., float]]:
    """``(compute_time(node), comm_time(node, nbytes=None))`` in seconds on ``profile``: what
    the scheduling passes take. ``nbytes`` asks for the collective's time at another size."""
    profile = get_profile(profile)

    def compute_time(node: fx.Node) -> float:
        return node_time(node, profile)

    def comm_time(node: fx.Node, nbytes: int | None = None) -> float:
        c = collective_of(node)
        return collective_time(c.kind, c.nbytes if nbytes is None else nbytes, c.ranks, profile)

    return compute_time, comm_time


# The profile's workspace and input copy are what its backend's collectives of each kind do;
# an all-to-all run as a reduce-scatter (passes/gloo.py) has neither: it sends from its input
# and receives into its output.


def workspace(profile: str | DeviceProfile) -> Callable[[fx.Node], int]:
    """``bytes(node)``: what a collective node allocates besides its input and output while in
    flight on ``profile`` (:attr:`DeviceProfile.comm_workspace`); 0 for other nodes."""
    profile = get_profile(profile)

    def workspace_bytes(node: fx.Node) -> int:
        c = collective_of(node)
        return 0 if c is None or is_exchange(node) else int(profile.comm_workspace.get(c.kind, 0.0) * c.nbytes)

    return workspace_bytes


def input_copied(kinds: Collection[str]) -> Callable[[fx.Node], bool]:
    """``copied(node)``: whether a collective node's backend copies its input at the issue,
    for the collective ``kinds`` whose backend does (:attr:`DeviceProfile.comm_input_copied`),
    so the input is free from then on."""
    return CollectiveMemory(input_copied=tuple(kinds)).copies_input


def schedule_config(profile: str | DeviceProfile, collectives: CollectiveMemory | None = None) -> ScheduleConfig:
    """What the step model, the scheduler, the bucket planner and the simulator read of
    ``profile``, built once and passed whole: its estimators (:func:`estimators`), its
    workspace, the profile itself as their figures, and what its collectives' buffers hold
    (``collectives``: as the graph's passes leave them, ``pipeline.gloo_memory``; None: as
    the profile says)."""
    profile = get_profile(profile)
    compute_time, comm_time = estimators(profile)
    if collectives is None:
        collectives = CollectiveMemory(profile.comm_release_late, (), profile.comm_input_copied)
    return ScheduleConfig(compute_time, comm_time, profile, workspace(profile), collectives)
