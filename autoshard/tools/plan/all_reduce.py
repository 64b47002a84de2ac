"""On a mixed cluster, fewer and larger all-reduces for the replicated layout the plan keeps.

A hybrid layout's replica all-reduce crosses every node, paced by the slowest type's NICs; its
ring pays a latency per step per bucket, one bucket per block. With the batch split by speed,
the compute that hid that stream shrinks, and the latency shows. The all-reduces of k blocks
in one bucket (the backend option ``all_reduce_blocks``) pay it once, for a bucket k times
the size that starts once the k-th block's gradients are ready. :func:`merge_all_reduces`
tries k = 2, 4, 8, ... on the fastest fitting layout with all-reduces, each compiled and played
as any candidate, while the mixed step improves.

The single-type plan (every rank as the slowest, even shares) never gets these candidates:
``mixed_summary.single_type_outcome`` leaves them out, so the comparison is with the plan a
single-type cluster gets.
"""
from __future__ import annotations

import dataclasses
from typing import Any

ALL_REDUCES = ("hybrid", "replicate")  # the strategies whose gradients cross replicas by all-reduce


def _all_reduces(o: Any) -> bool:
    c = o.candidate
    return c.all_reduce_blocks == 1 and (c.strategy in ALL_REDUCES or c.block_strategy in ALL_REDUCES)


def merge_all_reduces(search: Any, blocks: int) -> None:
    """Add to ``search`` (the planner's ``_Search``) the fastest fitting layout with all-reduces
    compiled with k = 2, 4, 8, ... blocks per all-reduce while k < ``blocks``, stopping at the
    first k that does not fit or is not faster than the best so far (a larger bucket starts
    later: past the best k, the step only grows)."""
    fitting = [o for o in search.outcomes if o.mixed_fits and _all_reduces(o)]
    best = min(fitting, key=lambda o: (o.mixed_step, max(t.peak_bytes for t in o.types)), default=None)
    k = 2
    while best is not None and k < blocks:
        o = search.add(dataclasses.replace(best.candidate, all_reduce_blocks=k))
        if not o.mixed_fits or o.mixed_step >= best.mixed_step:
            return
        best, k = o, 2 * k
