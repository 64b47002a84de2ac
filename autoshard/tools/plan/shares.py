"""How ``autoshard.plan`` splits the global batch over a mixed cluster's rank types, for one
compiled layout: each type's share starts proportional to its speed (the inverse of its
simulated compute at an even share), is capped where a type's memory would not hold more
(only the batch-sized part of its memory moves with its share; where even state shards do not
fit a type at all and the layout can cut them, every type holds a state share proportional to
its memory, :mod:`autoshard.tools.plan.state_shares`), and
is then refined on the mixed-cluster simulator (:mod:`autoshard.tools.sim.mixed_cluster`): a few
rounds that move samples towards the types that finished their compute early, keeping the
split with the shortest simulated step.
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.tools.plan.state_shares import memory_factors, with_state
from autoshard.tools.report.report import Report
from autoshard.tools.sim.cluster import Cluster
from autoshard.tools.sim.mixed_cluster import TypeStep, most_factor, scaled_peak, step_times

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


def play(report: Report, cluster: Cluster, extra_bytes: float, default_budget_gb: float | None,
         state_shares: bool = False) -> MixedStep:
    """The best split of ``report``'s layout over ``cluster`` that fits every type's memory
    (``extra_bytes``: per-rank bytes the report's peak leaves out, the optimizer state); the
    even split, over budget, when none fits. ``state_shares``: the layout can cut the state
    unevenly (strategies "full" and "grad_op")."""
    fwd, bwd = report.stages["forward"], report.stages.get("backward")
    by_category = report.analysis.memory_by_category
    counts = [g.ranks for g in cluster.nodes]
    world = cluster.world_size
    limits = [None if (gb := g.memory_gb if g.memory_gb is not None else default_budget_gb) is None else gb * 2**30
              for g in cluster.nodes]
    state = [1.0] * len(counts)
    caps = [most_factor(by_category, extra_bytes, limit) for limit in limits]
    if state_shares and (min(caps) == 0.0 or _capped(state, counts, caps, world) is None) and (
            shared := memory_factors(by_category, extra_bytes, limits, counts, world, _capped)) is not None:
        # Even state does not fit a type: each holds a share of the state proportional to its memory.
        state = shared
        caps = [most_factor(with_state(by_category, s, max(state)), extra_bytes * s, limit) for s, limit in zip(state, limits)]
    curves = [with_state(by_category, s, max(state)) for s in state]

    def result(factors: list[float]) -> MixedStep:
        step, busy, wait = step_times(fwd, bwd, cluster, factors, report.group_ranks, comm_factor=max(state))
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
