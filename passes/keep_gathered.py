"""Decide, per bucket, whether gathered parameters are freed after forward."""
from __future__ import annotations

from torch import fx

from autoshard._compat import c10d, must_save, recompute_region

from .bucket import plan_buckets
from .graph_utils import PARAMS, collectives, mib_to_bytes, nbytes


def keep_last_bucket_gathered(
    joint: fx.GraphModule, bucket_mb: float | None = None, max_inflight_bytes: int | None = None
) -> fx.GraphModule:
    """Let the forward's last gather bucket stay gathered into the backward.

    The last block's parameters are the first the backward needs; re-gathering them right
    after the forward freed them costs a collective that nothing can hide. Guarantees: in a
    lowered joint graph, the recompute-tagged gathers of the last bucket (as
    :func:`plan_buckets` groups the forward's gathers) and their views are retagged
    MUST_SAVE, when twice the bucket (it, and the next bucket prefetched beside it) fits
    ``max_inflight_bytes``. Other gathers are untouched; numerics unchanged.
    """
    gathers = [g for g in collectives(joint.graph, c10d.all_gather_into_tensor.default) if PARAMS in g.meta]
    resharded = [g for g in gathers if recompute_region(g) is not None]
    if not resharded or resharded[-1] is not gathers[-1]:
        return joint
    last = plan_buckets(gathers, mib_to_bytes(bucket_mb))[-1]
    if max_inflight_bytes is not None and 2 * sum(map(nbytes, last)) > max_inflight_bytes:
        return joint
    regions = {recompute_region(g) for g in last} - {None}
    for node in joint.graph.nodes:
        if recompute_region(node) in regions:
            must_save(node)
    return joint
