"""State shares in the plan: when a rank type's memory cannot hold an even share of the
parameters, gradients and optimizer state, each type holds a share proportional to its memory
(``autoshard.shard(..., state_shares=)``, :mod:`autoshard.runtime.state_shares`).

Memory of a rank type at state factor ``s`` (``world_size`` times its state share; 1 is
even): its sharded parameters, gradients and optimizer state scale by ``s``. Its gathered
parameters and collective buffers scale by the widest factor ``max(s)``: gloo and NCCL have
no all-gather-v, so every shard is padded to the widest share and a gather moves
``world_size * max(rows)`` rows. The same factor prices the collectives' time
(:func:`autoshard.tools.sim.mixed_cluster.step_times`'s ``comm_factor``).
"""
from __future__ import annotations

from autoshard.tools.sim.mixed_cluster import scaled_peak

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
                   world: int, capped) -> list[float] | None:
    """Each rank type's state factor (``sum(counts * factors) == world``): proportional to its
    memory limit, each capped at what its memory holds (:func:`most_state`), the padding to the
    widest share refined a few times; None where a type has no limit or the caps hold less.
    ``capped``: autoshard.tools.plan.shares' proportional split under caps."""
    if any(limit is None for limit in limits):
        return None
    widest, factors = 1.0, None
    for _ in range(4):
        caps = [most_state(memory_by_category, extra, limit, widest, world) for limit in limits]
        factors = capped(list(limits), counts, caps, world)
        if factors is None or max(factors) <= widest + 1e-6:
            return factors
        widest = max(factors)
    return factors


def per_rank(factors: list[float], counts: list[int], world: int) -> tuple[float, ...]:
    """Each global rank's state share (summing to 1) from its type's factor."""
    return tuple(f / world for f, n in zip(factors, counts) for _ in range(n))
