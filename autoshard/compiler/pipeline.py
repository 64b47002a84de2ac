"""The backend's pipeline, declared once: which passes run on which graph, in which order, for
which ``schedule`` option, and which stages are written between them.

The backend runs these lists (:func:`run`), the dumps take their stage names from them and the
report its stage order (:data:`STAGES`) and its words for each step (:func:`what_happened`).
Adding a pass is one entry here plus its file in ``passes/``. Each pass states what it
requires and provides; :func:`check_order` verifies every list, for every schedule, when this
module is imported, so a misordered list fails at once instead of compiling a wrong graph.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence, Union

from torch import fx

from autoshard._compat import save_random_ops_in_checkpoints
from autoshard.compiler.bucket_plan import choose_bucket_mb
from autoshard.compiler.consistency import check_ranks_agree, rank0s
from autoshard.compiler.logs import phase
from autoshard.compiler.options import SCHEDULES
from autoshard.cost.cost_model import GLOO_RELEASE_LATE, collective_of
from autoshard.passes import (
    bucket_collectives,
    free_collective_buffers,
    gather_inputs_held,
    gathers_in_place,
    gathers_into_buffers,
    inductor_schedule,
    lower_annotations,
    merge_shared_parameters,
    normalize_collectives,
    reductions_by_exchange,
    schedule_overlap,
    unbatch_annotations,
)
from autoshard.passes.graph_utils import is_copy, mib_to_bytes
from autoshard.passes.schedule import PLAN, apply_plan
from autoshard.passes.schedule_config import CollectiveMemory, ScheduleConfig
from autoshard.passes.telemetry import time_waits
from autoshard.runtime.batch_shares import uneven_shares_in_use

# What a graph holds, as passes require and provide it.
ANNOTATIONS = "annotation ops"  # every graph starts with them (Dynamo's reads, gathered by compiler/ghosts.py)
UNBATCHED = "one annotation op per parameter"
MERGED = "shared parameters merged"
LOWERED = "lowered collectives"
RECOMPUTE_TAGS = "recompute tags"
BUCKETS = "buckets"
ORDERED = "scheduled order"  # Inductor must keep this order (see KEEP_ORDER in backend.py)
RNG_SAVED = "random ops saved"

OURS = ("autoshard", "fsdp2")  # the schedules that bucket and prefetch with autoshard's passes


@dataclass
class Context:
    """What a pass may read besides its graph: the backend's options, the side of the graph
    (``"joint"``, ``"forward"``, ``"backward"``) and what the device profile says to price it
    (``cost_model.schedule_config``; None on the joint graph, which is scheduled only after
    partitioning)."""

    options: Any
    side: str
    schedule: ScheduleConfig | None = None
    # Set by the bucketing step for the schedule: the bucket cap it chose and the plan found for it.
    bucket_mb: float | None = None
    plan: Any = None
    param_bytes: int = 0  # this rank's parameter shards: with the optimizer state, held outside the graphs
    # The ranks already agreed on the compile's cache key, which fixes the plan (consistency.keys_agree).
    key_agreed: bool = False
    # On the joint graph, when the backend compiles again: the most blocks to keep gathered beyond
    # the first (passes/keep.py), fewer than the last compile kept and the schedule could not fit.
    keep_at_most: int | None = None

    @property
    def follow_rank0(self) -> bool:
        """Whether each rank takes rank 0's bucket and schedule decisions: ranks given unequal
        batch shares see other activation shapes and would decide otherwise. Only then: every
        exchange must be made by every rank alike, and these are made on every rank here."""
        return uneven_shares_in_use() and not self.key_agreed


@dataclass(frozen=True)
class Pass:
    """One step: ``run(graph, context)`` changes the graph in place. ``what``: the report's
    words for it (None: it changes nothing a reader sees)."""

    name: str
    run: Callable[[fx.GraphModule, Context], Any]
    what: str | None
    requires: frozenset[str] = frozenset()
    provides: frozenset[str] = frozenset()
    schedules: tuple[str, ...] = SCHEDULES


@dataclass(frozen=True)
class Stage:
    """Where a copy of the graph is written, as ``<name>.py`` (``{side}``: forward or backward).
    ``what``: the report's words for what made the graph before it (None: the passes did)."""

    name: str
    what: str | None = None
    schedules: tuple[str, ...] = SCHEDULES

    def stage(self, side: str) -> str:
        return self.name.format(side=side)


Step = Union[Pass, Stage]


def _schedule(gm: fx.GraphModule, ctx: Context, budget: int | None, plan: Any = None, only_plan: bool = False) -> None:
    opts, config = ctx.options, ctx.schedule
    policy = config.figures.fsdp2_policy(ctx.side)  # FSDP2 eager on this side and device
    # "fsdp2": FSDP2 eager's policy on the same buckets (it prefetches the next one on GPUs).
    limits = dict(zip(("max_prefetch", "max_reduces_in_flight"), policy)) if opts.schedule == "fsdp2" else {}
    if opts.schedule == "fsdp2":
        limits["blocking"] = config.figures.fsdp2_blocking
    # Held outside this graph: optimizer state and, during the backward, the parameter shards
    # (the forward's placeholders already hold them). Gradients are the backward's outputs.
    outside = opts.optimizer_states * ctx.param_bytes + (ctx.param_bytes if ctx.side == "backward" else 0)
    schedule_overlap(
        gm, _rank_independent(config), max_inflight_bytes=mib_to_bytes(opts.max_inflight_mb), **limits,
        memory_budget_bytes=budget, outside_bytes=outside,
        # Without a budget, never more memory than FSDP2 eager on this device; its policy's plan is a candidate.
        no_more_than=policy if opts.schedule == "autoshard" else None,
        shards_outside=ctx.side == "backward", plan=plan, only_plan=only_plan,
    )


def _budget(ctx: Context) -> int | None:
    gib = ctx.options.memory_budget_gb
    return None if gib is None else int(gib * 2**30)


def _bucket(gm: fx.GraphModule, ctx: Context) -> None:
    opts = ctx.options
    ctx.bucket_mb, ctx.plan = opts.bucket_mb, None
    if opts.schedule == "autoshard" and opts.bucket_mb is None and ctx.schedule is not None:
        # The bucket size is the planner's to choose (autoshard.compiler.bucket_plan); the
        # graph it bucketed for that size is the one to go on with.
        timing = _rank_independent(ctx.schedule)
        timing = replace(timing, compute_time=functools.cache(timing.compute_time))
        schedule = lambda g, b: _schedule(g, ctx, b, only_plan=True)  # noqa: E731
        ctx.bucket_mb, ctx.plan, chosen = choose_bucket_mb(gm, schedule, _budget(ctx), timing, _opaque_copies(opts),
                                                           opts.all_reduce_blocks)
        agreed = rank0s(ctx.bucket_mb, ctx.side) if ctx.follow_rank0 else ctx.bucket_mb
        if agreed == ctx.bucket_mb:
            gm.graph = chosen.graph
        else:
            ctx.bucket_mb, ctx.plan = agreed, None
            bucket_collectives(gm, agreed, _opaque_copies(opts), opts.all_reduce_blocks)
    else:
        if ctx.follow_rank0:  # the same exchanges on every rank, whichever way it buckets
            rank0s(ctx.bucket_mb, ctx.side)
        bucket_collectives(gm, ctx.bucket_mb, _opaque_copies(opts), opts.all_reduce_blocks)


def _opaque_copies(opts: Any) -> bool:
    # Inductor would fuse each bucket's copies into their neighbours, at each bucket's own
    # offsets: kernels of their own for every bucket layout (41 against plain's 19 at 4 layers).
    return opts.compiler == "inductor"


def _schedule_overlap(gm: fx.GraphModule, ctx: Context) -> None:
    _schedule(gm, ctx, _budget(ctx), ctx.plan, only_plan=True)
    # Rank 0's plan on every rank, whatever its batch share, placed on the graph as bucketed.
    own = gm.meta[PLAN]
    plan = rank0s(own, ctx.side) if ctx.follow_rank0 else own
    if (len(plan.distances), len(plan.blocked)) != (len(own.distances), len(own.blocked)):
        plan = own  # other buckets than rank 0's: check_ranks_agree names the difference on every rank
    apply_plan(gm, plan)
    if ctx.bucket_mb is not None and ctx.options.bucket_mb is None:  # the planner split the buckets
        plan = gm.meta[PLAN]
        gm.meta[PLAN] = replace(plan, forced=(f"buckets split to {ctx.bucket_mb:.3g} MiB at most",) + plan.forced)


def _rank_independent(config: ScheduleConfig) -> ScheduleConfig:
    # Pads move different bytes on different ranks (zero rows where a shard is full): pricing
    # them would let a scheduler decide differently per rank. Data movement is priced at zero.
    compute_time = config.compute_time
    return replace(config, compute_time=lambda n: 0.0 if is_copy(n) else compute_time(n))


def _frees_its_buffers(compiler: str) -> bool:
    return compiler != "inductor"  # Inductor plans (and reuses) its own buffers


def _gloo(gm: fx.GraphModule, ctx: Context) -> None:
    gathers_into_buffers(gm)
    reductions_by_exchange(gm)
    if _frees_its_buffers(ctx.options.compiler):  # Inductor plans its own buffers (and no out= ops)
        gathers_in_place(gm)
        free_collective_buffers(gm)
    else:  # ... but it must not reuse a gather's input while the gather sends from it
        gather_inputs_held(gm)


def _time_waits(gm: fx.GraphModule, ctx: Context) -> None:
    if ctx.options.telemetry:
        time_waits(gm, collective_of)


def gloo_memory(late_release: tuple[str, ...], copied: tuple[str, ...], compiler: str) -> CollectiveMemory:
    """What the memory model must assume of collectives given what :func:`_gloo` does to the
    graph, from the profile's ``late_release`` and ``copied`` kinds (whose input its backend
    copies: gloo's reduce-scatter). There reduce-scatters become all-to-alls, which read their
    input until the wait (what they receive is the copy's bytes, the profile's workspace).
    Graphs that free their buffers make a reduce-scatter's result at its wait, and concatenate
    a gather's input into its buffer (no input of its own from the issue on); Inductor's leave
    gloo's buffers to gloo's thread, which frees them late."""
    if "reduce_scatter" not in copied:
        return CollectiveMemory(late_release, (), copied)
    copied = tuple(k for k in copied if k != "reduce_scatter")
    if _frees_its_buffers(compiler):
        return CollectiveMemory(late_release, ("reduce_scatter",), copied + ("all_gather",))
    return CollectiveMemory(late_release + GLOO_RELEASE_LATE, (), copied)


def _inductor_schedule(gm: fx.GraphModule, ctx: Context) -> None:
    config = _rank_independent(ctx.schedule)
    inductor_schedule(gm, config.compute_time, config.comm_time)


def _keep_budget(ctx: Context) -> int | None:
    """The bytes within which the joint graph keeps more gathered blocks for the backward
    (passes/keep.py): the memory budget less the optimizer state, which the graphs do not hold;
    None without a budget, or under unequal batch shares, where ranks see other activation
    sizes and would keep different blocks."""
    gb = ctx.options.memory_budget_gb
    if gb is None or uneven_shares_in_use():
        return None
    return int(gb * 2**30) - ctx.options.optimizer_states * ctx.param_bytes


# The graph Dynamo hands the backend.
CAPTURED: tuple[Step, ...] = (Stage("captured"),)

# AOT autograd's joint forward+backward graph (not built for inference graphs).
JOINT: tuple[Step, ...] = (
    # Written with one annotation op per parameter: the joint graph as a reader expects it.
    Pass("unbatch_annotations", lambda gm, ctx: unbatch_annotations(gm),
         None, frozenset({ANNOTATIONS}), frozenset({UNBATCHED})),
    Stage("joint", what="AOT autograd: traced to ATen, forward and backward in one joint graph"),
    Pass("save_random_ops_in_checkpoints", lambda gm, ctx: save_random_ops_in_checkpoints(gm),
         None, provides=frozenset({RNG_SAVED})),  # a torch 2.13 bug, see autoshard/_compat.py
    Pass("merge_shared_parameters", lambda gm, ctx: merge_shared_parameters(gm),
         "shared parameters merged", frozenset({UNBATCHED}), frozenset({MERGED})),
    Pass("lower_annotations",
         lambda gm, ctx: lower_annotations(gm, ctx.options.reshard_after_forward, _keep_budget(ctx), ctx.keep_at_most),
         "annotations replaced by collectives", frozenset({MERGED}), frozenset({LOWERED, RECOMPUTE_TAGS})),
    Stage("lowered"),
)

# Each graph the partitioner makes (or, for inference, AOT autograd directly).
PARTITION = "partition"  # the report's word for the min-cut partitioner between the two lists
INFERENCE = "AOT autograd: traced to ATen (inference: no backward)"
PARTITIONED: tuple[Step, ...] = (
    # A graph compiled without autograd never went through JOINT; idempotent otherwise.
    Pass("unbatch_annotations", lambda gm, ctx: unbatch_annotations(gm), None, frozenset({ANNOTATIONS}), frozenset({UNBATCHED})),
    Pass("lower_annotations", lambda gm, ctx: lower_annotations(gm), "lower", frozenset({UNBATCHED}), frozenset({LOWERED})),
    # The partitioner leaves gathers nothing reads and merges equal reductions into one with two
    # waits; the passes after this one see one wait and a use per collective.
    Pass("normalize_collectives", lambda gm, ctx: normalize_collectives(gm), "collectives nothing reads dropped, repeated waits merged",
         frozenset({LOWERED})),
    Pass("bucket_collectives", _bucket,
         "bucket: per-parameter collectives merged into flat ones", frozenset({LOWERED}), frozenset({BUCKETS}), OURS),
    Stage("{side}_bucketed", schedules=OURS),
    Pass("schedule_overlap", _schedule_overlap, "schedule: prefetch and reorder within the memory budget",
         frozenset({BUCKETS}), frozenset({ORDERED}), OURS),
    Pass("inductor_schedule", _inductor_schedule, 'schedule "inductor": PyTorch\'s bucketing and overlap scheduler',
         frozenset({LOWERED}), frozenset({ORDERED}), ("inductor",)),
    # Every rank must issue the same collectives in the same order: checked last, on the final order.
    Pass("check_ranks_agree", lambda gm, ctx: ctx.key_agreed or check_ranks_agree(gm, ctx.side), None, frozenset({LOWERED})),
    # gloo corrupts its heap with several out-of-place gathers in flight, and frees what it
    # holds when it likes (see passes/gloo.py).
    Pass("gloo", _gloo, "over gloo, gathers write into buffers, reduce-scatters run as all-to-alls, and the graph frees "
         "their buffers after their last use", frozenset({LOWERED})),
    # Last, on the order that runs: autoshard.Telemetry's per-kind wait times and bytes.
    Pass("time_waits", _time_waits, None, frozenset({LOWERED})),
    Stage("{side}"),
)

SIDES = ("forward", "backward")


def stage_names(steps: Sequence[Step], side: str = "") -> tuple[str, ...]:
    return tuple(s.stage(side) for s in steps if isinstance(s, Stage))


# Every stage the backend may write, in pipeline order. Inference graphs have no joint, lowered
# or backward stages; schedules outside OURS no *_bucketed.
STAGES: tuple[str, ...] = (
    *stage_names(CAPTURED), *stage_names(JOINT), *(name for side in SIDES for name in stage_names(PARTITIONED, side))
)


def check_order(steps: Sequence[Step], given: frozenset[str] = frozenset({ANNOTATIONS}), where: str = "pipeline") -> None:
    """Raise ValueError unless, for every schedule, each pass that runs finds what it requires
    provided by ``given`` or by a pass that runs before it."""
    for schedule in SCHEDULES:
        have = set(given)
        for step in steps:
            if not isinstance(step, Pass) or schedule not in step.schedules:
                continue
            missing = step.requires - have
            if missing:
                raise ValueError(
                    f"autoshard {where}: pass {step.name!r} requires {sorted(missing)}, which no pass before it "
                    f"provides under schedule {schedule!r}; move it after the pass that provides them."
                )
            have |= step.provides


def keeps_order(schedule: str) -> bool:
    """Whether the partitioned graphs of ``schedule`` end in a scheduled order, which the inner
    compiler must keep."""
    return any(isinstance(s, Pass) and ORDERED in s.provides and schedule in s.schedules for s in PARTITIONED)


def run(steps: Sequence[Step], gm: fx.GraphModule, ctx: Context, write: Callable[[str, fx.GraphModule], None]) -> fx.GraphModule:
    """Run the steps that apply to ``ctx.options.schedule`` on ``gm`` in order; ``write(stage,
    graph)`` at each stage."""
    for step in steps:
        if ctx.options.schedule not in step.schedules:
            continue
        if isinstance(step, Stage):
            write(step.stage(ctx.side), gm)
        else:
            with phase(step.name):  # autoshard.<pass> in torch._dynamo.utils.compile_times()
                step.run(gm, ctx)
    return gm


def _sequence(side: str) -> list[Step | str]:
    # Everything a graph of ``side`` goes through, stages resolved; PARTITION marks the partitioner.
    resolved = [Stage(s.stage(side), s.what, s.schedules) if isinstance(s, Stage) else s for s in PARTITIONED]
    return [*CAPTURED, *JOINT, PARTITION, *resolved]


_JOINT_PASSES = {s.name for s in JOINT if isinstance(s, Pass)}


def what_happened(before: str, after: str) -> str:
    """The report's words for what the backend did between stage ``before`` and stage ``after``
    of one graph: the steps in between that run under a schedule which writes both stages and
    none of the stages in between (an inference graph skips the joint ones)."""
    seq = _sequence("backward" if after.startswith("backward") else "forward")
    names = [s.name if isinstance(s, Stage) else None for s in seq]
    first = names.index(before)
    between = seq[first + 1 : names.index(after) + 1]
    skipped = [s for s in between[:-1] if isinstance(s, Stage)]
    inference = any(s.name == "joint" for s in skipped)
    joint_steps = set(map(id, JOINT))
    schedules = [
        sch for sch in SCHEDULES
        if (sch in seq[first].schedules and sch in between[-1].schedules
                and all(sch not in s.schedules for s in skipped if id(s) not in joint_steps))
    ]
    steps = [INFERENCE] if inference else []
    for step in between:
        if step == PARTITION:
            steps.append(PARTITION if not inference else None)
        elif id(step) in joint_steps if inference else id(step) not in joint_steps and step.name in _JOINT_PASSES:
            continue  # the joint steps did not run, or (a pass run again after them) do nothing new
        elif any(sch in step.schedules for sch in schedules):
            steps.append(step.what)
    return ", then ".join(s for s in steps if s)


check_order(JOINT, where="joint pipeline")
check_order(PARTITIONED, where="partitioned pipeline")  # inference graphs come with annotations only
