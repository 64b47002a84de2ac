"""``autoshard.plan(..., tensor_parallel=(1, 2, 4, 8))``: the tensor-parallel degree chosen with the sharding.

Each degree ``tp`` (inside a node: it divides ``ranks_per_node`` and the world) leaves
``dp = world / tp`` data-parallel ranks that share the global batch (``global_batch``
sequences per step; the ``tp`` ranks of a ``dp`` rank read the same ones), so each compiles with
``global_batch / dp`` sequences per rank. A degree whose ``dp`` exceeds the global batch is not
compiled: FSDP needs at least one sequence per rank. The others are compiled as the user runs
them: a 2-D mesh ``(dp, tp)``, ``parallelize_module(model, mesh["tp"], tp_plan(model))``, then
``autoshard.shard(model, mesh["dp"], strategy=...)`` with full shard or ZeRO-2 over ``dp`` (tp 1:
also hybrid over one node), in each precision asked for (int8 gathers only at tp 1: they do not
compose with tensor parallelism). The simulator then prices DTensor's tensor-parallel
all-reduces from their group's ranks like any collective (within a node: NVLink), blocking the
compute that reads them; autoshard's gathers and reductions run over ``dp``. The plan is the
fastest candidate whose peak (optimizer state included) fits the budget (every candidate moves
the same global batch, so the step compares throughput); :attr:`Plan.tensor_parallel_why`
(printed by :meth:`Plan.summary`) says why its degree won.

``depth=Depth(make, blocks)`` prices a model too large to compile whole on the planning
machine: each candidate is compiled with ``compiled`` (two) block counts of ``make(n)`` and its
step, exposed communication, peak and energy extrapolated linearly to ``blocks`` (each block
adds the same compute, collectives and saved activations). The memory budget is then judged on
the extrapolated peak, not compiled into the schedule.
"""
from __future__ import annotations

import argparse
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from autoshard.compiler.options import parse_options
from autoshard.cost.cost_model import get_profile
from autoshard.runtime.errors import OverBudgetError, UsageError, over_budget_in
from autoshard.runtime.shard import is_sharded, shard
from autoshard.runtime.tp_plans import gpt_tp_plan, transformers_tp_plan
from autoshard.tools.explain import explain, load_factory
from autoshard.tools.plan.layouts import PRECISIONS, Candidate
from autoshard.tools.plan.result import Outcome, Plan, _compression, _limit_bytes, _mixed_precision
from autoshard.tools.units import fmt_bytes, fmt_time

# plan()'s keywords that turn this search on (plan.py hands them here).
TP_ARGUMENTS = ("tensor_parallel", "tp_plan", "global_batch", "depth")
_STAGES = ("captured", "forward", "backward")
OVER_BUDGET = "does not fit the budget"


@dataclass(frozen=True)
class Depth:
    """The model built with ``n`` repeated blocks by ``make(n)``; ``blocks``: the real count;
    ``compiled``: the two counts compiled, whose difference prices a block."""

    make: Callable[[int], nn.Module]
    blocks: int
    compiled: tuple[int, int] = (2, 4)

    def __post_init__(self) -> None:
        a, b = self.compiled
        if not (callable(self.make) and 1 <= a < b and self.blocks >= 1):
            raise UsageError(f"autoshard.plan: depth=Depth(make, blocks, compiled=(a, b)) needs a callable make and 1 <= a < b, "
                             f"got compiled={self.compiled!r}, blocks={self.blocks!r}.")


def degrees(tensor_parallel: Any, world_size: int, ranks_per_node: int) -> tuple[int, ...]:
    """The degrees searched, checked: each inside a node (divides ``ranks_per_node``) and the world."""
    if isinstance(tensor_parallel, int):
        tensor_parallel = (tensor_parallel,)
    tps = tuple(tensor_parallel) if isinstance(tensor_parallel, (tuple, list)) else ()
    bad = [t for t in tps if isinstance(t, bool) or not isinstance(t, int) or t < 1 or ranks_per_node % t or world_size % t]
    if not tps or bad:
        raise UsageError(f"autoshard.plan: tensor_parallel must be degrees that divide ranks_per_node={ranks_per_node} and "
                         f"world_size={world_size} (tensor parallelism stays inside a node), e.g. (1, 2, 4, 8); got {tensor_parallel!r}.")
    return tuple(sorted(set(tps)))


def candidates(tps: tuple[int, ...], world_size: int, ranks_per_node: int, precisions: tuple[str, ...]) -> list[Candidate]:
    """Per degree (ascending: a tie keeps the smaller), full shard and ZeRO-2 over dp; at tp 1 also
    hybrid over one node. Ties go to the earlier."""
    out = []
    for t in tps:
        dp = world_size // t
        layouts = [("full", (dp,)), ("grad_op", (dp,))]
        if t == 1 and dp > ranks_per_node and dp % ranks_per_node == 0:
            layouts.append(("hybrid", (dp // ranks_per_node, ranks_per_node)))
        out += [Candidate(s, shape, p, tensor_parallel=t) for s, shape in layouts for p in precisions
                if t == 1 or not p.endswith("int8")]
    return out


def local_inputs(example_args: tuple, batch: int) -> tuple:
    """``example_args`` with each tensor's first dimension (the batch) set to ``batch``."""
    return tuple(torch.zeros((batch, *a.shape[1:]), dtype=a.dtype) if isinstance(a, torch.Tensor) and a.dim() else a
                 for a in example_args)


def builder(factory: Callable[[], nn.Module], c: Candidate, tp_plan: Callable[[nn.Module], dict] | None) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = factory()
        if is_sharded(model):
            raise UsageError("autoshard.plan: the factory returned a sharded model; return it unsharded: the plan chooses the sharding.")
        precision = _mixed_precision(c.precision)
        if c.tensor_parallel == 1:
            return shard(model, init_device_mesh("cpu", c.mesh_shape), strategy=c.strategy, mixed_precision=precision,
                         compression=_compression(c.precision))
        mesh = init_device_mesh("cpu", (c.mesh_shape[0], c.tensor_parallel), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan(model))
        with warnings.catch_warnings():  # shard compares the fake parameters' data_ptr (no storage): a warning
            warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
            return shard(model, mesh["dp"], strategy=c.strategy, mixed_precision=precision)
    return make


@dataclass(frozen=True)
class _Job:
    """What every candidate is compiled with."""

    factory: Callable[[], nn.Module]
    example_args: tuple
    world_size: int
    global_batch: int
    tp_plan: Callable[[nn.Module], dict] | None
    options: dict  # explain's: profile, the backend options, the budget
    states: int  # optimizer states per parameter shard
    depth: Depth | None

    def skip(self, c: Candidate) -> str | None:
        dp = self.world_size // c.tensor_parallel
        if self.global_batch < dp:
            return f"skipped: {self.global_batch} sequences < {dp} data-parallel ranks (FSDP needs one per rank)"
        if self.global_batch % dp:
            return f"skipped: {self.global_batch} sequences do not split evenly over {dp} data-parallel ranks"
        return None

    def _played(self, factory: Callable[[], nn.Module], c: Candidate, budget: bool) -> tuple[float, float, float, float | None]:
        """(step, exposed communication, peak with optimizer state, energy) of one compile."""
        options = self.options if budget else {k: v for k, v in self.options.items() if k != "memory_budget_gb"}
        args = local_inputs(self.example_args, self.global_batch // c.mesh_shape[0] // (c.mesh_shape[1] if len(c.mesh_shape) > 1 else 1))
        report = explain(builder(factory, c, self.tp_plan), *args, world_size=self.world_size, stages=_STAGES, **options)
        a = report.simulation.analysis
        return a.step_time, a.exposed_comm, a.peak_bytes + self.states * report.metrics["shard_bytes"], a.energy_j

    def outcome(self, c: Candidate) -> Outcome:
        skip = self.skip(c)
        if skip is not None:
            return Outcome(c, error=skip)
        try:
            if self.depth is None:
                step, exposed, peak, energy = self._played(self.factory, c, budget=True)
            else:  # two depths, each figure extrapolated linearly to the real one
                (a, b), n = self.depth.compiled, self.depth.blocks
                lo, hi = (self._played(lambda k=k: self.depth.make(k), c, budget=False) for k in (a, b))
                step, exposed, peak, energy = (None if x is None else x + (y - x) * (n - a) / (b - a) for x, y in zip(lo, hi))
        except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's error; the budget's is an outcome
            if over_budget_in(e) is not None:
                return Outcome(c, error=OVER_BUDGET)
            if c.tensor_parallel == 1:
                raise
            # e.g. a degree that does not divide the heads: the others still stand
            return Outcome(c, error=f"does not compile: {type(e).__name__}: {str(e).strip().splitlines()[0][:100]}")
        return Outcome(c, step, exposed, int(peak), energy_j=energy)


def _why(chosen: Outcome, outcomes: list[Outcome], global_batch: int, world: int, limit: float) -> str:
    """Why the chosen degree: what each other degree lacked (the batch, the memory, the speed)."""
    t = chosen.candidate.tensor_parallel
    name = lambda d: "FSDP alone (tp 1)" if d == 1 else f"tp {d}"  # noqa: E731
    batch, reasons = [], []
    for d in sorted({o.candidate.tensor_parallel for o in outcomes} - {t}):
        mine = [o for o in outcomes if o.candidate.tensor_parallel == d]
        fits = [o for o in mine if o.error is None and o.peak_bytes <= limit]
        if fits:
            best = min(fits, key=lambda o: o.step_time)
            reasons.append(f"{name(d)} is slower: {fmt_time(best.step_time)} a step against {fmt_time(chosen.step_time)} "
                           f"({best.step_time / chosen.step_time:.2f}x)")
        elif all(o.error is not None and o.error.startswith("skipped: ") and "sequences" in o.error for o in mine):
            batch.append(d)
        else:
            peaks = [o.peak_bytes for o in mine if o.error is None]
            need = f"its smallest peak is {fmt_bytes(min(peaks))}" if peaks else "no schedule of it fits"
            reasons.append(f"{name(d)} does not fit the memory budget ({need}, budget {fmt_bytes(limit)})")
    if batch:  # first: the reason FSDP alone cannot run at all
        ranks = " and ".join(str(world // d) for d in batch)
        reasons.insert(0, f"{' and '.join(map(name, batch))} would leave {ranks} data-parallel ranks for a global batch of "
                       f"{global_batch} sequences (FSDP needs at least one sequence per rank)")
    head = f"tp {t} x dp {world // t}"
    return f"{head}: the only degree searched" if not reasons else f"{head}, because " + "; ".join(reasons)


def plan_tensor_parallel(factory: Callable[[], nn.Module], *example_args: Any, world_size: int | None, ranks_per_node: int | None,
                         memory_budget_gb: float | None, profile: Any, precisions: tuple[str, ...],
                         progress: Callable[[str], None] | None = None, tensor_parallel: Any = (1,),
                         tp_plan: Callable[[nn.Module], dict] | None = None, global_batch: int | None = None,
                         depth: Depth | None = None, cluster: Any = None, **options: Any) -> Plan:
    """:func:`autoshard.plan` over tensor-parallel degrees too (this module's docstring).
    ``global_batch``: sequences per step over the whole job (None: the example inputs' batch on
    every rank, ``batch * world_size``); ``tp_plan(model)``: the ``parallelize_module`` plan
    (e.g. :func:`autoshard.transformers_tp_plan`), needed for a degree above 1."""
    if cluster is not None:  # a homogeneous one arrives as its world size and profile
        raise UsageError("autoshard.plan: tensor_parallel is planned for one type of rank; pass world_size, ranks_per_node and "
                         "profile instead of a mixed cluster.")
    if world_size is None:
        raise UsageError("autoshard.plan: pass world_size (the ranks to plan for).")
    ranks_per_node = 8 if ranks_per_node is None else ranks_per_node
    tps = degrees(tensor_parallel, world_size, ranks_per_node)
    if any(t > 1 for t in tps) and not callable(tp_plan):
        raise UsageError("autoshard.plan: tensor_parallel above 1 needs tp_plan, the parallelize_module plan of the model, e.g. "
                         "tp_plan=autoshard.transformers_tp_plan (or autoshard.gpt_tp_plan for examples/gpt.py).")
    if depth is not None and not isinstance(depth, Depth):
        raise UsageError(f"autoshard.plan: depth must be an autoshard.tools.plan.tensor_parallel.Depth, got {type(depth).__name__}.")
    first = example_args[0] if example_args else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise UsageError("autoshard.plan: with tensor_parallel, the first example input must be a batch (a tensor whose first "
                         "dimension is the sequences per rank).")
    if global_batch is None:
        global_batch = first.shape[0] * world_size
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise UsageError(f"autoshard.plan: global_batch must be a positive int (sequences per step, all ranks), got {global_batch!r}.")
    if not precisions or not set(precisions) <= set(PRECISIONS):
        raise UsageError(f"autoshard.plan: precisions must be some of {PRECISIONS}, got {precisions!r}.")
    states = parse_options({"compiler": "aot_eager", **options}).optimizer_states
    device = dataclasses.replace(get_profile("h100" if profile is None else profile), ranks_per_node=ranks_per_node)
    budget = {} if memory_budget_gb is None else {"memory_budget_gb": memory_budget_gb}
    job = _Job(factory, example_args, world_size, global_batch, tp_plan, {"profile": device, **budget, **options}, states, depth)
    outcomes = []
    for c in candidates(tps, world_size, ranks_per_node, tuple(precisions)):
        outcomes.append(o := job.outcome(c))
        if progress is not None:
            progress(f"autoshard plan: {c.label(ranks_per_node)}: " + (o.error or f"step {fmt_time(o.step_time)}, "
                                                                        f"peak {fmt_bytes(o.peak_bytes)}"))
    limit = _limit_bytes(memory_budget_gb)
    fitting = [(o.step_time, o.peak_bytes, i, o) for i, o in enumerate(outcomes) if o.error is None and o.peak_bytes <= limit]
    if not fitting:
        if all(o.error and o.error.startswith("skipped: ") for o in outcomes):
            raise UsageError(f"autoshard.plan: no tensor-parallel degree of {tps} leaves at most {global_batch} data-parallel ranks "
                             f"of {world_size} (one sequence per rank at least); raise the global batch, use fewer ranks, or add "
                             "pipeline or context parallelism (not built).")
        peaks = [o.peak_bytes for o in outcomes if o.error is None]
        smallest = min(peaks, default=None)
        raise OverBudgetError(f"autoshard.plan: no layout of {world_size} ranks at tensor-parallel degrees {tps} fits "
                              f"memory_budget_gb={memory_budget_gb}"
                              + ("" if smallest is None else f"; the smallest candidate peak is {smallest / 2**30:.3f} GiB"),
                              smallest_bytes=smallest)
    chosen = min(fitting, key=lambda x: x[:3])[3]
    best = chosen.candidate
    seq = first[0].numel()  # tokens per sequence, when the first input holds token ids
    return Plan(best.strategy, best.mesh_shape, world_size, ranks_per_node, device.name, memory_budget_gb, tuple(outcomes),
                best.precision, tokens_per_step=global_batch * seq if not first.is_floating_point() else None,
                tensor_parallel=best.tensor_parallel, global_batch=global_batch,
                tensor_parallel_why=_why(chosen, outcomes, global_batch, world_size, limit))


# -- command line ------------------------------------------------------------------------------

NAMED_PLANS = {"transformers": transformers_tp_plan, "gpt": gpt_tp_plan}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``autoshard plan``'s tensor-parallel flags."""
    parser.add_argument("--tensor-parallel", type=int, nargs="+", metavar="TP",
                        help="tensor-parallel degrees to choose among, e.g. 1 2 4 8 (each divides --ranks-per-node); needs --tp-plan")
    parser.add_argument("--tp-plan", metavar="PLAN", help="the parallelize_module plan: transformers (the model config's own), "
                        "gpt (examples/gpt.py's), or FILE.py:FUNCTION / MODULE:FUNCTION taking the model")
    parser.add_argument("--global-batch", type=int, help="sequences per step over all ranks, shared by the data-parallel ranks "
                        "(with --tensor-parallel; default: --batch on every rank)")


def arguments(args: argparse.Namespace) -> dict[str, Any]:
    """plan()'s tensor-parallel keywords from the flags ({} without --tensor-parallel: the search as before)."""
    if args.tensor_parallel is None:
        if args.tp_plan is not None or args.global_batch is not None:
            raise UsageError("autoshard plan: --tp-plan and --global-batch go with --tensor-parallel; add the degrees to choose "
                             "among, e.g. --tensor-parallel 1 2 4 8.")
        return {}
    tp_plan = args.tp_plan and (NAMED_PLANS.get(args.tp_plan) or load_factory("autoshard plan", args.tp_plan))
    given = {"global_batch": args.global_batch} if args.global_batch is not None else {}
    return {"tensor_parallel": tuple(args.tensor_parallel), "tp_plan": tp_plan, **given}
