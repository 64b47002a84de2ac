"""autoshard's graph passes: each a deterministic ``GraphModule -> GraphModule`` function.

Installed as ``autoshard.passes``. Their order, stages and schedules are declared in
``autoshard/compiler/pipeline.py``; in short: on the joint forward+backward graph,
unbatch_annotations, merge_shared_parameters then lower_annotations; on each
partitioned graph, normalize_collectives, bucket_collectives then schedule_overlap (or PyTorch's own scheduler,
inductor_schedule, as a baseline), then over gloo gathers_into_buffers, reductions_by_exchange and, for graphs run op
by op, gathers_in_place and free_collective_buffers (for Inductor, gather_inputs_held).
"""
from .bucket import bucket_collectives, plan_buckets, planned_buckets
from .gloo import free_collective_buffers, gather_inputs_held, gathers_in_place, gathers_into_buffers, reductions_by_exchange
from .inductor_schedule import inductor_schedule
from .lower import lower_annotations
from .merge_shared import merge_shared_parameters
from .normalize import normalize_collectives
from .schedule import schedule_overlap
from .unbatch import unbatch_annotations

__all__ = [
    "bucket_collectives",
    "planned_buckets",
    "free_collective_buffers",
    "gather_inputs_held",
    "gathers_in_place",
    "gathers_into_buffers",
    "inductor_schedule",
    "lower_annotations",
    "merge_shared_parameters",
    "normalize_collectives",
    "plan_buckets",
    "reductions_by_exchange",
    "schedule_overlap",
    "unbatch_annotations",
]
