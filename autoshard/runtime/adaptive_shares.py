"""Batch shares that follow the measured speed of each rank (``autoshard.Telemetry(...,
adapt_shares=True, global_batch=B)``).

Real clusters drift: a GPU throttles, a neighbour saturates a link, a node is swapped for an
older one. A split planned once from a profile is then wrong. Each time the ranks exchange their
telemetry (every ``every`` steps), every rank computes the next split from the same records:
each rank's speed is the samples it took over its busy time (its step less its waits in
collectives, median over the window), the target gives every rank samples in proportion to its
speed, and the split moves only part of the way there (``damping``) and only when some rank's
count would change by ``min_change`` samples at least, so that noise neither makes it oscillate
nor changes it every window. Damping is against noise, not change: where the busiest rank's time
exceeds the least busy one's by more than ``jump`` (a rank slowed or sped up, not jitter), the
split goes all the way at once (bench/drift.py: with damping alone, half of a 30-step half went
by before the split caught up with a moved slowdown). Counts are whole samples of the global batch, so every split
trains exactly like one process on the whole batch (:mod:`autoshard.runtime.batch_shares`).
``split_batch`` marks the local batch dimension dynamic from the first step on, so every rank
compiles one graph for every split, alike: were it left to Dynamo's automatic dynamic shapes,
a rank whose size changed would recompile while one whose size stayed would not, and the ranks
would wait on each other's plans. Create the Telemetry before the first compiled step.
"""
from __future__ import annotations

from typing import Sequence

from autoshard.runtime.batch_shares import round_to_total
from autoshard.runtime.errors import UsageError

# Each rank keeps two samples at least: a batch dimension of 1 would be compiled as a constant.
LEAST = 2


def next_split(sizes: Sequence[int], busy_s: Sequence[float], *, damping: float = 0.5, min_change: int = 1,
               jump: float | None = 1.25) -> list[int] | None:
    """The next samples per rank from the current ``sizes`` and each rank's measured busy
    seconds, or None to keep the current split. Deterministic: every rank that passes the same
    figures gets the same answer. Every rank keeps :data:`LEAST` samples at least. ``jump``:
    the busy-time ratio (busiest over least busy) above which the split is not damped (None:
    always damped)."""
    if min(busy_s) <= 0:
        return None  # a rank measured no busy time: nothing to go on
    if jump is not None and max(busy_s) > jump * min(busy_s):
        damping = 1.0
    total = sum(sizes)
    speed = [s / b for s, b in zip(sizes, busy_s)]
    wanted = [s + damping * (total * v / sum(speed) - s) for s, v in zip(sizes, speed)]
    # LEAST samples each, then what is left in proportion to what each wants beyond them.
    spare = total - LEAST * len(sizes)
    beyond = [max(w - LEAST, 0.0) for w in wanted]
    scale = spare / sum(beyond) if sum(beyond) else 0.0
    new = [LEAST + n for n in round_to_total([b * scale for b in beyond], spare)]
    if max(abs(n - s) for n, s in zip(new, sizes)) < min_change:
        return None
    return new


def check(global_batch: int | None, world: int, damping: float, min_change: int, jump: float | None) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < LEAST * world:
        raise UsageError(f"autoshard.Telemetry: adapt_shares needs global_batch, the samples of one step over all ranks "
                         f"(at least {LEAST} per rank, {LEAST * world}), got {global_batch!r}.")
    if not 0 < damping <= 1:
        raise UsageError(f"autoshard.Telemetry: damping must be in (0, 1] (the part of the way to the measured split "
                         f"taken at once), got {damping!r}.")
    if jump is not None and (isinstance(jump, bool) or not isinstance(jump, (int, float)) or not jump > 1):
        raise UsageError(f"autoshard.Telemetry: jump must be a busy-time ratio above 1 (or None: always damped), got {jump!r}.")
    if isinstance(min_change, bool) or not isinstance(min_change, int) or min_change < 1:
        raise UsageError(f"autoshard.Telemetry: min_change must be a whole number of samples >= 1, got {min_change!r}.")
