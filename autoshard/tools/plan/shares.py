"""How ``autoshard.plan`` splits the global batch over a mixed cluster's rank types, for one
compiled layout: each type's share starts proportional to its speed (the inverse of its
simulated compute at an even share), is capped where a type's memory would not hold more
(only the batch-sized part of its memory moves with its share; where even state shards do not
fit a type at all and the layout can cut them, every type holds a state share proportional to
its memory: the state shares below), and
is then refined on the mixed-cluster simulator (:mod:`autoshard.cost.mixed_cluster`): a few
rounds that move samples towards the types that finished their compute early, keeping the
split with the shortest simulated step.
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.cluster import Cluster
from autoshard.cost.mixed_cluster import TypeStep, most_factor, scaled_peak, step_times
from autoshard.cost.simulator import Simulation

ROUNDS = 6  # refinements on the simulator after the proportional split


@dataclass(frozen=True)
class MixedStep:
    """A layout on a mixed cluster: the simulated step with the chosen shares, and per type."""

    step_time: float
    types: tuple[TypeStep, ...]

    @property
    def fits(self) -> bool:
        return all(t.fits for t in self.types)


def _capped(weights: list[float], counts: list[int], caps: list[float], world: int) -> list[float] | None:
    """Factors proportional to ``weights`` with ``sum(counts * factors) == world``, each at most
    its cap (the rest spread over the uncapped types the same way); None if the caps hold less."""
    if sum(n * c for n, c in zip(counts, caps)) < world * (1 - 1e-9):
        return None
    fixed: dict[int, float] = {}
    while True:
        free = [t for t in range(len(weights)) if t not in fixed]
        left = world - sum(counts[t] * f for t, f in fixed.items())
        scale = left / sum(counts[t] * weights[t] for t in free)
        over = [t for t in free if weights[t] * scale > caps[t]]
        if not over:
            return [fixed.get(t, weights[t] * scale) for t in range(len(weights))]
        fixed.update({t: caps[t] for t in over})


def best_split(simulation: Simulation, cluster: Cluster, extra_bytes: float, default_budget_gb: float | None,
               state_shares: bool = False) -> MixedStep:
    """The best split of ``simulation``'s layout over ``cluster`` that fits every type's memory
    (``extra_bytes``: per-rank bytes its peak leaves out, the optimizer state); the even split,
    over budget, when none fits. ``state_shares``: the layout can cut the state unevenly
    (strategies "full" and "grad_op")."""
    fwd, bwd = simulation.forward, simulation.backward
    by_category = simulation.analysis.memory_by_category
    counts = [g.ranks for g in cluster.nodes]
    world = cluster.world_size
    limits = [None if (gb := g.memory_gb if g.memory_gb is not None else default_budget_gb) is None else gb * 2**30
              for g in cluster.nodes]
    state = [1.0] * len(counts)
    caps = [most_factor(by_category, extra_bytes, limit) for limit in limits]
    if state_shares and (min(caps) == 0.0 or _capped(state, counts, caps, world) is None) and (
            shared := memory_factors(by_category, extra_bytes, limits, counts, world)) is not None:
        # Even state does not fit a type: each holds a share of the state proportional to its memory.
        state = shared
        caps = [most_factor(with_state(by_category, s, max(state)), extra_bytes * s, limit) for s, limit in zip(state, limits)]
    curves = [with_state(by_category, s, max(state)) for s in state]

    def result(factors: list[float]) -> MixedStep:
        step, busy, wait = step_times(fwd, bwd, cluster, factors, simulation.group_ranks, comm_factor=max(state))
        return MixedStep(step, tuple(
            TypeStep(g.name, g.ranks, f / world, b, w, int(scaled_peak(curve, f) + extra_bytes * s), limit, g.price_per_hour,
                     None if max(state) == 1.0 else s / world)
            for g, f, b, w, limit, s, curve in zip(cluster.nodes, factors, busy, wait, limits, state, curves)))

    even = result([1.0] * len(counts))
    factors = _capped([1.0 / max(t.busy, 1e-12) for t in even.types], counts, caps, world)
    if factors is None:
        return even
    tries = [even] if even.fits else []
    for _ in range(ROUNDS):
        tried = result(factors)
        tries.append(tried)
        # Each type's speed as measured at its current factor: samples per second of compute.
        speeds = [f / max(t.busy, 1e-12) for f, t in zip(factors, tried.types)]
        nxt = _capped(speeds, counts, caps, world)
        if nxt is None or max(abs(a - b) for a, b in zip(nxt, factors)) < 1e-4:
            break
        factors = nxt
    return min(tries, key=lambda m: m.step_time)


# State shares in the plan: when a rank type's memory cannot hold an even share of the
# parameters, gradients and optimizer state, each type holds a share proportional to its memory
# (``autoshard.shard(..., state_shares=)``, :mod:`autoshard.runtime.state_shares`).
#
# Memory of a rank type at state factor ``s`` (``world_size`` times its state share; 1 is
# even): its sharded parameters, gradients and optimizer state scale by ``s``. Its gathered
# parameters and collective buffers scale by the widest factor ``max(s)``: gloo and NCCL have
# no all-gather-v, so every shard is padded to the widest share and a gather moves
# ``world_size * max(rows)`` rows. The same factor prices the collectives' time
# (:func:`autoshard.cost.mixed_cluster.step_times`'s ``comm_factor``).
STATE = ("shards", "gradients")  # memory categories a rank's state share scales
PADDED = ("gathered", "comm_buffers")  # memory categories the widest share scales (padding)


def with_state(memory_by_category: dict[str, list[int]], factor: float, widest: float) -> dict[str, list[int]]:
    """``memory_by_category`` (an even-state curve) at state factor ``factor``, every shard padded
    to ``widest`` in the collectives."""
    scale = {c: factor for c in STATE} | {c: widest for c in PADDED}
    return {c: [int(v * scale.get(c, 1.0)) for v in curve] for c, curve in memory_by_category.items()}


def most_state(memory_by_category: dict[str, list[int]], extra: float, limit: float, widest: float, world: int) -> float:
    """The largest state factor (at most ``world``: all of it) a rank of memory ``limit`` holds
    at an even batch, every shard padded to ``widest`` or to its own share where wider
    (``extra``: its optimizer state at an even share); 0 if none."""
    def fits(factor: float) -> bool:
        curve = with_state(memory_by_category, factor, max(widest, factor))
        return scaled_peak(curve, 1.0) + extra * factor <= limit

    if not fits(0.0):
        return 0.0
    lo, hi = 0.0, float(world)
    if fits(hi):
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def memory_factors(memory_by_category: dict[str, list[int]], extra: float, limits: list[float | None], counts: list[int],
                   world: int) -> list[float] | None:
    """Each rank type's state factor (``sum(counts * factors) == world``): proportional to its
    memory limit, each capped at what its memory holds (:func:`most_state`), the padding to the
    widest share refined a few times; None where a type has no limit or the caps hold less."""
    if any(limit is None for limit in limits):
        return None
    widest, factors = 1.0, None
    for _ in range(4):
        caps = [most_state(memory_by_category, extra, limit, widest, world) for limit in limits]
        factors = _capped(list(limits), counts, caps, world)
        if factors is None or max(factors) <= widest + 1e-6:
            return factors
        widest = max(factors)
    return factors


def per_rank(factors: list[float], counts: list[int], world: int) -> tuple[float, ...]:
    """Each global rank's state share (summing to 1) from its type's factor."""
    return tuple(f / world for f, n in zip(factors, counts) for _ in range(n))
