"""``autoshard.plan``: choose the sharding strategy for the user, on fake ranks.

Each candidate layout of the world (full shard, ZeRO-2, replicate, and hybrid sharding with a shard group of 1, 2, 4, ... nodes;
for a mixture-of-experts model, the 1-D ones also with the experts split over every rank, ``experts="parallel"``) is compiled for
one training step as ``autoshard.explain`` compiles it, with the memory budget's schedule decisions inside, and played on the cost
model; a layout whose lower bounds (:mod:`autoshard.tools.plan.layouts`: its collectives alone, its shards, gradients and
optimizer state alone) already lose is not compiled. Where the fastest layout does not fit the budget, the fastest that does is
tried with as many of the model's repeated blocks laid out as the faster one as the budget holds (a mixed layout: those blocks
sharded first, as FSDP2 users shard per block). The plan is the fastest candidate whose peak (optimizer state included) fits the
budget; ties go to the smaller peak, then to the earlier candidate. Deterministic: the same model, world and profile give every
rank the same plan; ``autoshard.shard(model, plan=plan)`` applies it::

    plan = autoshard.plan(make_model, tokens, tokens, world_size=64, ranks_per_node=8, memory_budget_gb=40)
    print(plan.summary()); plan.save("plan.json")
    plan = autoshard.Plan.load("plan.json")                                        # on every rank
    model = autoshard.shard(make_model(), plan=plan)
    compiled = torch.compile(model, backend="autoshard", options=plan.compile_options)

With ``precisions=("fp32", "bf16")`` each layout is also tried in bfloat16 (gradients reduced in float32); a mixed layout keeps
one precision. Lossy choices only where listed: ``"int8"`` and ``"bf16_int8"`` gather int8 with float32 scales
(``autoshard.Compression(gather="int8")``) and compute in float32 or bfloat16; the summary then says what the chosen layout's
gathers save against the same layout uncompressed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autoshard._compat import fake_tensor_mode
from autoshard.compiler.options import parse_options
from autoshard.cost.cluster import Cluster
from autoshard.cost.cost_model import get_profile
from autoshard.runtime.errors import OverBudgetError, UsageError, over_budget_in
from autoshard.runtime.shard import is_sharded, shard
from autoshard.tools.explain import add_input_arguments, explain, input_maker, load_factory
from autoshard.tools.plan import tensor_parallel
from autoshard.tools.plan.layouts import PRECISIONS, Bounds, Candidate, Params, candidates
from autoshard.tools.plan.result import Outcome, Plan, _compression, _limit_bytes, _mixed_precision
from autoshard.tools.plan.shares import best_split
from autoshard.tools.units import fmt_bytes, fmt_time


def _sharding(factory: Callable[[], nn.Module], c: Candidate) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = factory()
        if is_sharded(model):
            raise UsageError("autoshard.plan: the factory returned a sharded model; return it unsharded: the plan chooses "
                             "the sharding.")
        precision, compression = _mixed_precision(c.precision), _compression(c.precision)
        if c.blocks:  # blocks first, then the root, as with FSDP2's fully_shard
            block_mesh = init_device_mesh("cpu", c.block_mesh_shape)
            for name in c.blocks:
                shard(model.get_submodule(name), block_mesh, strategy=c.block_strategy, mixed_precision=precision,
                      compression=compression)
        return shard(model, init_device_mesh("cpu", c.mesh_shape), strategy=c.strategy, mixed_precision=precision,
                     experts=c.experts, compression=compression)

    return make


def _past_the_best_hybrid(outcomes: list[Outcome], limit: float) -> bool:
    """Whether the hybrid candidates tried so far in one precision (shard groups growing) already passed the
    fastest that fits: the last one fits and is slower than the one before it. A bigger shard
    group holds less per rank but moves more of each gather across nodes, so from there on
    the step only grows (an assumption that keeps planning at 1024 ranks to a few compiles)."""
    tried = [o for o in outcomes if o.candidate.strategy == "hybrid" and o.candidate.whole and o.error is None]
    return len(tried) >= 2 and tried[-1].peak_bytes <= limit and tried[-1].step_time > tried[-2].step_time


OVER_BUDGET = "does not fit the budget"  # an outcome's error when the budget's schedule failed its compile
_STAGES = ("captured", "forward", "backward")  # what an outcome's metrics read
TRIES = 2  # compiles of mixed layouts per precision and pair of layouts (each one a candidate's compile time)


class _Search:
    """The outcomes found so far, and how to add one (compile the candidate, or say why not)."""

    def __init__(self, factory: Callable[[], nn.Module], example_args: tuple, options: dict, bounds: Bounds, limit: float,
                 ranks_per_node: int, progress: Callable[[str], None] | None, cluster: Cluster | None = None,
                 budget_gb: float | None = None) -> None:
        # options: explain's keyword arguments (world_size, profile, the backend options).
        self.factory, self.example_args, self.options, self.bounds, self.limit = factory, example_args, options, bounds, limit
        self.ranks_per_node, self.progress = ranks_per_node, progress
        self.cluster, self.budget_gb = cluster, budget_gb  # a mixed cluster: each compile is also played on it
        self.outcomes: list[Outcome] = []
        self.smallest_over: int | None = None  # the least an over-budget candidate's schedule needed (OverBudgetError)

    def fitting(self, precision: str | None = None) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is None and o.peak_bytes <= self.limit
                and precision in (None, o.candidate.precision)]

    def fastest_fitting(self, precision: str | None = None) -> Outcome | None:
        return min(self.fitting(precision), key=lambda o: (o.step_time, o.peak_bytes), default=None)

    def why_not(self, c: Candidate) -> str | None:
        """Why compiling ``c`` cannot change the plan (its bounds), or None."""
        floor = self.bounds.memory(c)
        if floor > self.limit:
            return f"skipped: shards, gradients and optimizer state alone take {fmt_bytes(floor)}"
        best = self.fastest_fitting()
        if best is not None and self.bounds.step(c) >= best.step_time:
            return (f"skipped: its collectives alone take {fmt_time(self.bounds.step(c))}, "
                    f"slower than {best.candidate.label(self.ranks_per_node)}")
        return None

    def add(self, c: Candidate, skip: str | None = None) -> Outcome:
        if skip is not None:
            outcome = Outcome(c, error=skip)
        else:
            options = {**self.options, "all_reduce_blocks": c.all_reduce_blocks} if c.all_reduce_blocks > 1 else self.options
            try:
                report = explain(_sharding(self.factory, c), *self.example_args, stages=_STAGES, **options)
            except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's error; only the budget's is an outcome
                over = over_budget_in(e)
                if over is None:
                    raise
                if over.smallest_bytes is not None:
                    self.smallest_over = min(self.smallest_over or over.smallest_bytes, over.smallest_bytes)
                outcome = Outcome(c, error=OVER_BUDGET)
            else:
                a, shard_bytes = report.simulation.analysis, report.metrics["shard_bytes"]  # the latter: the captured graph's
                states = self.bounds.optimizer_states
                on_cluster = {}
                if self.cluster is not None:  # the same graphs on each rank type, with planned batch shares
                    can_cut_state = {c.strategy, c.block_strategy or c.strategy} <= {"full", "grad_op"} and c.experts == "gathered"
                    step = best_split(report.simulation, self.cluster, states * shard_bytes, self.budget_gb, state_shares=can_cut_state)
                    on_cluster = {"mixed_step": step.step_time, "types": step.types}
                outcome = Outcome(c, a.step_time, a.exposed_comm, int(a.peak_bytes + states * shard_bytes),
                                  energy_j=a.energy_j, link_bytes=self.bounds.link_bytes(c), **on_cluster)
        self.outcomes.append(outcome)
        if self.progress is not None:
            on_cluster = "" if outcome.mixed_step is None else f", on the mixed cluster {fmt_time(outcome.mixed_step)}"
            self.progress(f"autoshard plan: {c.label(self.ranks_per_node)}: " + (outcome.error or f"step {fmt_time(outcome.step_time)}, "
                          f"peak {fmt_bytes(outcome.peak_bytes)}{on_cluster}"))
        return outcome


def _whole_model(search: _Search, candidates: list[Candidate]) -> None:
    """Each of ``candidates`` (whole-model layouts), compiled only where its bounds leave it a
    chance; hybrid shard groups stop growing once one that fits is slower than the one before."""
    for c in candidates:
        skip = search.why_not(c)
        same = [o for o in search.outcomes if o.candidate.precision == c.precision]
        if skip is None and c.strategy == "hybrid" and _past_the_best_hybrid(same, search.limit):
            skip = "skipped: a smaller shard group that fits is faster"
        search.add(c, skip)


def _mixed_layouts(search: _Search, blocks: tuple[str, ...], precision: str) -> None:
    """Where a faster whole-model layout does not fit but a slower one does: the fastest that
    fits with as many repeated blocks laid out as the faster one as the budget holds: the
    first ones, whose gathers open the forward and whose reductions close the backward, where
    nothing hides them. The count comes from the state each block moves, then from what the
    compiled try showed a block to cost (:data:`TRIES` compiles at most: halfway back after a
    miss, halfway on to the predicted count after a fit that left room)."""
    # Only between gathered-experts layouts: experts="parallel" needs the 1-D mesh of every rank
    # for every experts module, which a block on a hybrid mesh does not have.
    gathered = [o for o in search.fitting(precision) if o.candidate.experts == "gathered"]
    slow = min(gathered, key=lambda o: (o.step_time, o.peak_bytes), default=None)
    if slow is None or not blocks or not slow.candidate.whole:
        return
    faster = [o.candidate for o in search.outcomes if o.candidate.precision == precision and o.candidate.whole
              and o.candidate.experts == "gathered"
              and (o.error == OVER_BUDGET or (o.error is None and o.peak_bytes > search.limit))
              and search.bounds.step(o.candidate) < slow.step_time]
    if not faster:
        return
    fast, s = min(faster, key=search.bounds.step), slow.candidate
    if any(o.candidate == s.mixed_layout(o.candidate.blocks, fast) for o in search.outcomes if o.candidate.blocks):
        return  # this pair was searched already
    room = search.limit - slow.peak_bytes
    gain = [search.bounds.memory(s.mixed_layout(blocks[: k + 1], fast)) - search.bounds.memory(s) for k in range(len(blocks))]
    k = sum(1 for g in gain if g <= room)
    fit, miss = 0, len(blocks) + 1  # the most blocks that fit, the fewest that did not
    for _ in range(TRIES):
        if not fit < k < miss:
            return
        o = search.add(s.mixed_layout(blocks[:k], fast))
        if o.error is None and o.peak_bytes <= search.limit:
            fit = k
            # Halfway to the count that what a block cost this time predicts (the schedule's
            # peak is not linear in it).
            per_block = (o.peak_bytes - slow.peak_bytes) / k
            most = len(blocks) if per_block <= 0 else min(len(blocks), int(room / per_block))
            k = k + max(1, (most - k) // 2) if most > k else k
        else:
            miss = k
            k = (fit + k) // 2


ALL_REDUCES = ("hybrid", "replicate")  # the strategies whose gradients cross replicas by all-reduce


def _all_reduces(o: Outcome) -> bool:
    c = o.candidate
    return c.all_reduce_blocks == 1 and (c.strategy in ALL_REDUCES or c.block_strategy in ALL_REDUCES)


def merge_all_reduces(search: _Search, blocks: int) -> None:
    """On a mixed cluster, fewer and larger all-reduces for the replicated layout the plan keeps.

    A hybrid layout's replica all-reduce crosses every node, paced by the slowest type's NICs;
    its ring pays a latency per step per bucket, one bucket per block. With the batch split by
    speed, the compute that hid that stream shrinks, and the latency shows. The all-reduces of
    k blocks in one bucket (the backend option ``all_reduce_blocks``) pay it once, for a bucket
    k times the size that starts once the k-th block's gradients are ready. Add to ``search``
    the fastest fitting layout with all-reduces compiled with k = 2, 4, 8, ... blocks per
    all-reduce while k < ``blocks``, each played as any candidate, stopping at the first k that
    does not fit or is not faster than the best so far (a larger bucket starts later: past the
    best k, the step only grows). The single-type plan (every rank as the slowest, even shares)
    never gets these candidates: ``mixed_summary.single_type_outcome`` leaves them out, so the
    comparison is with the plan a single-type cluster gets."""
    fitting = [o for o in search.outcomes if o.mixed_fits and _all_reduces(o)]
    best = min(fitting, key=lambda o: (o.mixed_step, max(t.peak_bytes for t in o.types)), default=None)
    k = 2
    while best is not None and k < blocks:
        o = search.add(dataclasses.replace(best.candidate, all_reduce_blocks=k))
        if not o.mixed_fits or o.mixed_step >= best.mixed_step:
            return
        best, k = o, 2 * k


def plan(
    factory: Callable[[], nn.Module], *example_args: Any, world_size: int | None = None, ranks_per_node: int | None = None,
    memory_budget_gb: float | None = None, profile: str | None = None, precisions: tuple[str, ...] = ("fp32",),
    progress: Callable[[str], None] | None = None, cluster: Cluster | None = None, **options: Any,
) -> Plan:
    """The fastest layout of ``factory``'s model over ``world_size`` ranks (``ranks_per_node`` per node) whose predicted peak
    per rank fits ``memory_budget_gb`` (optimizer state included; None: any), on ``profile``'s cost model. ``factory`` builds
    the model unsharded (called in a fake mode: no memory for weights); ``example_args`` and ``options`` are as for
    :func:`autoshard.explain`. ``precisions``: of :data:`PRECISIONS`, those a layout may gather and compute in.
    ``progress(line)`` gets a line per candidate.

    Whole-model layouts first (full shard and hybrid over one node always compiled, the others
    only where the lower bounds of :mod:`autoshard.tools.plan.layouts` leave them a chance), then, where the fastest does not
    fit the budget, the fastest that fits with as many of the model's repeated blocks as fit laid out as the faster one.
    OverBudgetError (a ValueError) when no candidate fits, naming the smallest peak one has.
    ``tensor_parallel=(1, 2, 4, 8)``, ``tp_plan``, ``global_batch``, ``depth``: the tensor-parallel degree chosen too
    (:mod:`autoshard.tools.plan.tensor_parallel`); left out, the search is as above.

    ``cluster`` (instead of ``world_size``, ``ranks_per_node`` and ``profile``): a
    :class:`~autoshard.cost.cluster.Cluster`. A homogeneous one gives exactly the plan of its
    profile and size (``memory_budget_gb``: its memory, where given). A mixed one: the
    candidates are compiled and searched as for the single-type plan: the cluster taken as all of
    its slowest type (every rank as slow and as small as the slowest); each compiled one is then
    played on the mixed cluster with the batch shares :mod:`autoshard.tools.plan.shares`
    chooses, and the plan is the fastest there whose every type fits its own memory
    (:attr:`Plan.batch_shares`: each rank's fraction of the global batch), and where even
    state shards do not fit a type's memory, state shares by memory (:attr:`Plan.state_shares`,
    :mod:`autoshard.tools.plan.shares`)."""
    if cluster is not None:
        if not isinstance(cluster, Cluster):
            raise UsageError(f"autoshard.plan: cluster must be an autoshard.cost.cluster.Cluster, got {type(cluster).__name__}.")
        given = [name for name, v in (("world_size", world_size), ("ranks_per_node", ranks_per_node), ("profile", profile))
                 if v is not None]
        if given:
            raise UsageError(f"autoshard.plan: pass either cluster or {', '.join(given)}: the cluster gives its ranks, nodes "
                             "and profiles.")
        memory_budget_gb = cluster.smallest_memory_gb(memory_budget_gb)
        if cluster.homogeneous:  # exactly the plan of its one profile and size
            return plan(factory, *example_args, world_size=cluster.world_size, ranks_per_node=cluster.ranks_per_node,
                        memory_budget_gb=memory_budget_gb, profile=cluster.nodes[0].profile, precisions=precisions,
                        progress=progress, **options)
        world_size, ranks_per_node = cluster.world_size, cluster.ranks_per_node
    if world_size is None:
        raise UsageError("autoshard.plan: pass world_size (the ranks to plan for), or a cluster.")
    ranks_per_node = 8 if ranks_per_node is None else ranks_per_node
    profile = "h100" if profile is None else profile
    if world_size < 1 or ranks_per_node < 1:
        raise UsageError(f"autoshard.plan: world_size and ranks_per_node must be at least 1, got {world_size} and {ranks_per_node}.")
    if set(options) & set(tensor_parallel.TP_ARGUMENTS):  # the tensor-parallel degree chosen too
        return tensor_parallel.plan_tensor_parallel(factory, *example_args, world_size=world_size, ranks_per_node=ranks_per_node,
                                                    profile=profile, memory_budget_gb=memory_budget_gb, precisions=precisions,
                                                    progress=progress, cluster=cluster, **options)
    if not precisions or not set(precisions) <= set(PRECISIONS):
        raise UsageError(f"autoshard.plan: precisions must be some of {PRECISIONS}, got {precisions!r}; e.g. ('fp32', 'bf16'), "
                         "or ('bf16', 'bf16_int8') to allow int8 gathers (lossy).")
    # Bad backend options fail here, before the first compile.
    states = parse_options({"compiler": "aot_eager", **options}).optimizer_states
    # The profile's links as the plan's nodes have them.
    device = dataclasses.replace(get_profile(profile), ranks_per_node=ranks_per_node)
    mixed_cluster = cluster is not None
    if mixed_cluster:  # compiled as the single-type plan: the cluster taken as all of its slowest type
        device = cluster.as_slowest()
    # Compiled and bounded under the pooled memory where the types' memories differ: state
    # shares may then hold the state by memory; each type's own limit is checked when played.
    compile_gb = cluster.pooled_memory_gb(memory_budget_gb) if mixed_cluster else memory_budget_gb
    budget = {} if compile_gb is None else {"memory_budget_gb": compile_gb}
    with fake_tensor_mode():
        params = Params.of(factory())
    limit = _limit_bytes(compile_gb)
    search = _Search(factory, example_args, {"world_size": world_size, "profile": device, **budget, **options},
                     Bounds(params, device, states), limit, ranks_per_node, progress, cluster, memory_budget_gb)
    whole = candidates(world_size, ranks_per_node, tuple(precisions), params.expert_parallel(world_size))
    # The baselines first, always compiled (full shard, hybrid over one node); then the mixed
    # layouts between them (blocks laid out as the faster one), whose steps let the bounds rule out more of the rest; then the rest.
    baselines = [c for c in whole if c.strategy == "full" or c.mesh_shape == (world_size // ranks_per_node, ranks_per_node)]
    for c in baselines:
        search.add(c)
    for precision in precisions:
        _mixed_layouts(search, tuple(params.blocks), precision)
    _whole_model(search, [c for c in whole if c not in baselines])
    for precision in precisions:  # the fastest that fits may have changed
        _mixed_layouts(search, tuple(params.blocks), precision)
    if mixed_cluster:
        merge_all_reduces(search, len(params.blocks))
    order = {c: i for i, c in enumerate(whole)}
    outcomes = sorted(search.outcomes, key=lambda o: order.get(o.candidate, len(order)))
    if mixed_cluster:  # each type under its own memory, at its planned share
        fitting = [(o.mixed_step, max(t.peak_bytes for t in o.types), i, o) for i, o in enumerate(outcomes) if o.mixed_fits]
    else:
        fitting = [(o.step_time, o.peak_bytes, i, o) for i, o in enumerate(outcomes) if o in search.fitting()]
    if not fitting:
        smallest = min((o.peak_bytes for o in outcomes if o.error is None), default=None)
        if smallest is not None:
            hint = f"; the smallest candidate peak is {smallest / 2**30:.3f} GiB"
        elif search.smallest_over is not None:  # every compiled candidate was over budget: what its schedule needs at least
            smallest = search.smallest_over
            hint = f"; the smallest candidate's schedule needs {smallest / 2**30:.3f} GiB before optimizer state"
        else:
            hint = ""
        raise OverBudgetError(f"autoshard.plan: no layout of {world_size} ranks fits memory_budget_gb={memory_budget_gb}{hint}; "
                              "raise the budget, use more ranks, or recompute activations (torch.utils.checkpoint).",
                              smallest_bytes=smallest)
    chosen = min(fitting, key=lambda t: t[:3])[3]
    best = chosen.candidate
    shares = tuple(t.share for t in chosen.types for _ in range(t.ranks)) if mixed_cluster else None
    state = tuple(t.state_share for t in chosen.types for _ in range(t.ranks)) if mixed_cluster and chosen.types[0].state_share else None
    return Plan(best.strategy, best.mesh_shape, world_size, ranks_per_node, cluster.label if mixed_cluster else device.name,
                memory_budget_gb, tuple(outcomes), best.precision, best.blocks, best.block_strategy, best.block_mesh_shape,
                _tokens(example_args, world_size), shares, cluster, best.experts, state, best.all_reduce_blocks)


def _tokens(example_args: tuple, world_size: int) -> int | None:
    """Tokens per step over all ranks when the first input holds token ids (an integer
    tensor): every rank takes a batch of that shape."""
    first = example_args[0] if example_args else None
    if isinstance(first, torch.Tensor) and not first.is_floating_point() and not first.is_complex() and first.numel():
        return first.numel() * world_size
    return None


# -- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``autoshard plan`` flags."""
    parser.description = ("Compile FACTORY's model (unsharded) at --world-size ranks once per sharding layout on a fake world, "
                          "print each one's predicted step and peak, and the fastest that fits --memory-budget-gb.")
    parser.add_argument("factory", metavar="FILE.py:FACTORY", help="a function returning the unsharded model, e.g. "
                        "examples/train_gpt.py:build_model; also MODULE:FACTORY")
    parser.add_argument("--world-size", type=int, help="ranks of the world to plan for (or --cluster)")
    parser.add_argument("--ranks-per-node", type=int, help="ranks per node (default 8)")
    parser.add_argument("--cluster", metavar="FILE.json", help='a mixed cluster instead of --world-size, --ranks-per-node and '
                        '--profile: {"nodes": [{"count": 4, "profile": "h100", "memory_gb": 80, "price_per_hour": 4.0}, ...]}')
    parser.add_argument("--memory-budget-gb", type=float, help="per-rank memory the plan must fit, optimizer state included (GiB)")
    parser.add_argument("--profile", help="device profile: h100 (default), a100, cpu or a .json from `autoshard calibrate`")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["fp32"],
                        help="precisions a layout may gather and compute in (bf16: gradients reduced in float32; "
                             "int8, bf16_int8: int8 gathers, lossy, tried only if listed)")
    add_input_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="write the plan here (autoshard.Plan.load reads it)")
    tensor_parallel.add_arguments(parser)


def _read_cluster(path: str) -> Cluster:
    try:
        return Cluster.from_dict(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"autoshard plan: cannot read the cluster {path!r}: {e}; write "
                         '{"nodes": [{"count": 4, "profile": "h100", "memory_gb": 80}, ...]}.') from None


def run(args: argparse.Namespace) -> int:
    """``autoshard plan``: a progress line per candidate, then the plan's summary."""
    try:
        factory = load_factory("autoshard plan", args.factory)
        make_inputs = input_maker("autoshard plan", args)
        with torch.device("meta"):  # only to read the inputs' shapes off the model's config
            example = make_inputs(factory())
        cluster = _read_cluster(args.cluster) if args.cluster else None
        result = plan(factory, *example, world_size=args.world_size, ranks_per_node=args.ranks_per_node,
                      memory_budget_gb=args.memory_budget_gb, profile=args.profile, precisions=tuple(args.precisions),
                      progress=lambda line: print(line, flush=True), cluster=cluster, **tensor_parallel.arguments(args))
    except ValueError as e:  # UsageError, OverBudgetError, ...: reported as one line, exit status 1
        message = str(e) if str(e).startswith("autoshard") else f"autoshard plan: {e}"
        sys.exit(message.replace("\n", " "))
    print(result.summary())
    if args.json:
        result.save(args.json)
        print(f"wrote {args.json}")
    return 0
