"""What PyTorch's CUDA caching allocator reserves over training steps of a simulated step: the
bridge from a :class:`~autoshard.cost.simulator.Simulation`'s storages (the liveness) to
:mod:`autoshard.cost.allocator`'s event replay, with what lives across steps (parameter
shards, gradients until ``zero_grad``, optimizer state) and on which stream each storage is
allocated."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from torch import fx

from autoshard.cost.allocator import Event as AllocatorEvent
from autoshard.cost.allocator import replay
from autoshard.cost.cost_model import schedule_config
from autoshard.cost.liveness import Liveness, Order, categorize, copy_in, saved_sources
from autoshard.cost.simulator import Simulation
from autoshard.passes.graph_utils import collective_kind


@dataclass(frozen=True)
class ReservedMemory:
    """Bytes per rank that PyTorch's CUDA caching allocator holds over training steps of a
    :class:`Simulation` (:func:`reserved_memory`): the last step's peak reserved (what
    ``torch.cuda.max_memory_reserved`` reads in steady state) and peak allocated, and both per
    step, the first step first."""

    peak_reserved_bytes: int
    peak_allocated_bytes: int
    reserved_per_step: tuple[int, ...]
    allocated_per_step: tuple[int, ...]


def _stream_of(live: Liveness, order: Order) -> list[str]:
    """Each storage's stream: FSDP2 allocates an all-gather's input and output buffers on its
    all-gather (copy-in) stream and a reduce-scatter's on its reduce-scatter stream (their
    copy-ins, casts to the reduce dtype included, run there); everything else is allocated on
    the compute stream."""
    feeds: dict[fx.Node, str] = {}
    for _, node in order:
        if (kind := collective_kind(node)) is not None:
            for n in [node, *copy_in(node)[0]]:
                feeds.setdefault(n, "all_gather" if kind == "all_gather" else "reduce_scatter")
    return [feeds.get(s.node, "compute") for s in live.storages]


def reserved_memory(sim: Simulation, *, steps: int = 3, expandable_segments: bool = False, optimizer_states: int = 0,
                    optimizer_temporaries: int = 0, capacity: int | None = None,
                    unmaterialized: Collection[fx.Node] = ()) -> ReservedMemory:
    """Replay ``steps`` training steps of ``sim``'s storages, in execution order, through the
    caching allocator of :mod:`autoshard.cost.allocator`.

    What lives across steps: forward placeholders (parameter shards, buffers, the batch) are
    allocated once, before the first step, and kept. Gradients (the backward's outputs) live
    until the next step's ``zero_grad`` (set to None): after the optimizer step. The optimizer
    allocates ``optimizer_states`` tensors the size of each parameter shard at its first step
    (after the first backward, gradients still alive: AdamW's lazy state init, exp_avg and
    exp_avg_sq per parameter) and keeps them; every step it allocates and frees
    ``optimizer_temporaries`` more per shard (the foreach AdamW's ``exp_avg_sq_sqrt``). Every
    other storage is allocated and freed within its step where the liveness says, but for the
    values of ``unmaterialized`` (a compiled run's fused intermediates,
    :func:`autoshard.cost.fusion.unmaterialized`): never allocated.
    Compute-only: takes longer than the simulation's own memory curve, so it is run on request.
    """
    forward, backward = sim.forward, sim.backward
    stages = [("forward", forward)] + ([("backward", backward)] if backward is not None else [])
    order = [(stage, node) for stage, gm in stages for node in gm.graph.nodes]
    sources = saved_sources(forward, backward)
    config = schedule_config(sim.profile)
    live = Liveness(order, sources, config.workspace, config.collectives.late_release, config.collectives.copies_input)
    categorize(live, order, sources)
    streams = _stream_of(live, order)
    kept = [i for i, s in enumerate(live.storages) if s.stage == "forward" and s.node.op == "placeholder"]
    shards = [i for i in kept if live.storages[i].category == "shards"]
    kept_set = set(kept)
    allocs: list[list[int]] = [[] for _ in range(live.end + 1)]
    frees: list[list[int]] = [[] for _ in range(live.end + 1)]
    size = {i: live.storages[i].nbytes for i in shards}
    hidden = set(unmaterialized)
    for i, s in enumerate(live.storages):
        if i not in kept_set and s.node not in hidden:
            allocs[s.alloc_at].append(i)
            frees[min(s.last_use, live.end)].append(i)
    events: list[AllocatorEvent] = [("alloc", ("kept", i), live.storages[i].nbytes, streams[i]) for i in kept]
    for step in range(steps):
        events.append(("step",))
        for pos in range(live.end + 1):
            events += [("alloc", (step, i), live.storages[i].nbytes, streams[i]) for i in allocs[pos]]
            if pos < live.end:
                events += [("free", (step, i)) for i in frees[pos]]
        # The optimizer step: lazy states on the first, then each step's temporaries; then zero_grad.
        if step == 0:
            events += [("alloc", ("state", i, k), size[i], "compute") for i in shards for k in range(optimizer_states)]
        events += [("alloc", ("temp", step, i, k), size[i], "compute") for k in range(optimizer_temporaries) for i in shards]
        events += [("free", ("temp", step, i, k)) for k in range(optimizer_temporaries) for i in shards]
        events += [("free", (step, i)) for i in frees[live.end]]
    stats = replay(events, expandable_segments=expandable_segments, capacity=capacity)
    return ReservedMemory(stats.reserved_peak_per_step[-1], stats.allocated_peak_per_step[-1],
                          tuple(stats.reserved_peak_per_step), tuple(stats.allocated_peak_per_step))
