"""``autoshard.plan``: choose the sharding strategy for the user, on fake ranks.

Each candidate layout of the world (full shard, ZeRO-2, replicate, and hybrid sharding with a
shard group of 1, 2, 4, ... nodes) is compiled for one training step as ``autoshard.explain``
compiles it, with the memory budget's schedule decisions inside, and played on the cost
model. The plan is the fastest candidate whose peak (optimizer state included) fits the
budget; ties go to the smaller peak, then to the earlier candidate. Deterministic: the same
model, world and profile give every rank the same plan, and ``autoshard.shard(model,
plan=plan)`` applies it::

    plan = autoshard.plan(make_model, tokens, tokens, world_size=64, ranks_per_node=8, memory_budget_gb=40)
    print(plan.summary()); plan.save("plan.json")
    model = autoshard.shard(make_model(), plan=autoshard.Plan.load("plan.json"))   # on every rank

With ``precisions=("fp32", "bf16")`` each layout is also tried in bfloat16 (gradients reduced
in float32). One strategy for the whole model (per-block strategies are not searched yet).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autoshard.compiler.options import parse_options
from autoshard.runtime.mixed_precision import MixedPrecision
from autoshard.runtime.shard import _SHARDED, shard
from autoshard.tools.explain import UsageError, add_input_arguments, explain, input_maker, load_factory
from autoshard.tools.report_svg import fmt_bytes, fmt_time

PRECISIONS = ("fp32", "bf16")  # bf16: gathered and computed in bfloat16, gradients reduced in float32


@dataclass(frozen=True)
class Candidate:
    """One layout of the world: a strategy, the mesh it shards over (``(world,)``, or
    ``(replicas, shard_size)`` for ``"hybrid"``) and the precision of gathers and compute."""

    strategy: str
    mesh_shape: tuple[int, ...]
    precision: str = "fp32"

    def label(self, ranks_per_node: int) -> str:
        name = self.strategy
        if self.strategy == "hybrid":
            nodes = self.mesh_shape[1] / ranks_per_node
            name = f"hybrid, shard over {nodes:g} node{'s' if nodes != 1 else ''}"
        return name if self.precision == "fp32" else f"{name}, {self.precision}"


@dataclass(frozen=True)
class Outcome:
    """A candidate as the cost model plays it; ``error`` when it does not compile (its budget)."""

    candidate: Candidate
    step_time: float | None = None  # seconds
    exposed_comm: float | None = None  # seconds
    peak_bytes: int | None = None  # per rank, optimizer state included
    error: str | None = None


def candidates(world_size: int, ranks_per_node: int, precisions: tuple[str, ...] = ("fp32",)) -> list[Candidate]:
    """The layouts searched, in the order ties are broken: full shard first, each layout in
    every precision of ``precisions``."""
    layouts = [("full", (world_size,)), ("grad_op", (world_size,))]
    shard_size = ranks_per_node
    while shard_size < world_size:
        if world_size % shard_size == 0:
            layouts.append(("hybrid", (world_size // shard_size, shard_size)))
        shard_size *= 2
    layouts.append(("replicate", (world_size,)))
    return [Candidate(strategy, shape, precision) for strategy, shape in layouts for precision in precisions]


@dataclass(frozen=True)
class Plan:
    """The chosen layout and what every candidate was predicted to cost."""

    strategy: str
    mesh_shape: tuple[int, ...]
    world_size: int
    ranks_per_node: int
    profile: str
    memory_budget_gb: float | None
    outcomes: tuple[Outcome, ...] = field(default=())
    precision: str = "fp32"

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.strategy, self.mesh_shape, self.precision)

    @property
    def chosen(self) -> Outcome:
        return next(o for o in self.outcomes if o.candidate == self.candidate)

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        """What ``autoshard.shard`` takes for the plan's precision."""
        return _mixed_precision(self.precision)

    def summary(self) -> str:
        budget = "none" if self.memory_budget_gb is None else f"{self.memory_budget_gb:g} GiB"
        lines = [f"plan for {self.world_size} ranks ({self.ranks_per_node} per node), profile {self.profile}, budget {budget}",
                 f"{'candidate':32s} {'mesh':>12s} {'step':>12s} {'exposed':>8s} {'peak per rank':>14s}"]
        for o in self.outcomes:
            c = o.candidate
            mark = "*" if c == self.candidate else " "
            name = f"{mark} {c.label(self.ranks_per_node)}"
            if o.error is not None:
                lines.append(f"{name:32s} {str(c.mesh_shape):>12s} {o.error:>36s}")
                continue
            over = "" if o.peak_bytes <= _limit_bytes(self.memory_budget_gb) else "  over budget"
            lines.append(f"{name:32s} {str(c.mesh_shape):>12s} {fmt_time(o.step_time):>12s} {o.exposed_comm / o.step_time:8.1%} "
                         f"{fmt_bytes(o.peak_bytes):>14s}{over}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> Plan:
        data = json.loads(text)
        outcomes = tuple(Outcome(**{**o, "candidate": Candidate(**{**o["candidate"], "mesh_shape": tuple(o["candidate"]["mesh_shape"])})})
                         for o in data.pop("outcomes"))
        return Plan(**{**data, "mesh_shape": tuple(data["mesh_shape"]), "outcomes": outcomes})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def load(path: str | Path) -> Plan:
        return Plan.from_json(Path(path).read_text())


def _limit_bytes(memory_budget_gb: float | None) -> float:
    return float("inf") if memory_budget_gb is None else memory_budget_gb * 2**30


def _mixed_precision(precision: str) -> MixedPrecision | None:
    return None if precision == "fp32" else MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _sharding(factory: Callable[[], nn.Module], c: Candidate) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = factory()
        if getattr(model, _SHARDED, False):
            raise ValueError("autoshard.plan: the factory returned a sharded model; return it unsharded: the plan chooses "
                             "the sharding.")
        return shard(model, init_device_mesh("cpu", c.mesh_shape), strategy=c.strategy, mixed_precision=_mixed_precision(c.precision))

    return make


def _over_budget(error: BaseException | None) -> bool:
    # The schedule's "below what this graph needs" error, possibly inside Dynamo's wrapper.
    while error is not None:
        if isinstance(error, ValueError) and "option 'memory_budget_gb'" in str(error):
            return True
        error = error.__cause__ or getattr(error, "inner_exception", None)
    return False


def _past_the_best_hybrid(outcomes: list[Outcome], limit: float) -> bool:
    """Whether the hybrid candidates tried so far in one precision (shard groups growing) already passed the
    fastest that fits: the last one fits and is slower than the one before it. A bigger shard
    group holds less per rank but moves more of each gather across nodes, so from there on
    the step only grows (an assumption that keeps planning at 1024 ranks to a few compiles)."""
    tried = [o for o in outcomes if o.candidate.strategy == "hybrid" and o.error is None]
    return len(tried) >= 2 and tried[-1].peak_bytes <= limit and tried[-1].step_time > tried[-2].step_time


def plan(
    factory: Callable[[], nn.Module], *example_args: Any, world_size: int, ranks_per_node: int = 8,
    memory_budget_gb: float | None = None, profile: str = "h100", precisions: tuple[str, ...] = ("fp32",),
    progress: Callable[[str], None] | None = None, **options: Any,
) -> Plan:
    """The fastest layout of ``factory``'s model over ``world_size`` ranks (``ranks_per_node``
    per node) whose predicted peak per rank fits ``memory_budget_gb`` (optimizer state
    included; None: any), on ``profile``'s cost model. ``factory`` builds the model unsharded
    (called in a fake mode: no memory for weights); ``example_args`` and ``options`` are as
    for :func:`autoshard.explain`. ``precisions``: of :data:`PRECISIONS`, those a layout may
    gather and compute in. ``progress(line)`` gets a line per candidate.
    ValueError when no candidate fits, naming the smallest peak one has."""
    if world_size < 1 or ranks_per_node < 1:
        raise ValueError(f"autoshard.plan: world_size and ranks_per_node must be at least 1, got {world_size} and {ranks_per_node}.")
    if not precisions or not set(precisions) <= set(PRECISIONS):
        raise ValueError(f"autoshard.plan: precisions must be some of {PRECISIONS}, got {precisions!r}; e.g. ('fp32', 'bf16').")
    # Bad backend options fail here, before the first compile.
    states = parse_options({"compiler": "aot_eager", **options}).optimizer_states
    budget = None if memory_budget_gb is None else {"memory_budget_gb": memory_budget_gb}
    limit = _limit_bytes(memory_budget_gb)
    outcomes: list[Outcome] = []
    for c in candidates(world_size, ranks_per_node, tuple(precisions)):
        if c.strategy == "hybrid" and _past_the_best_hybrid([o for o in outcomes if o.candidate.precision == c.precision], limit):
            continue
        try:
            report = explain(_sharding(factory, c), *example_args, world_size=world_size, profile=profile, **(budget or {}), **options)
        except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's error; only the budget's is an outcome
            if not _over_budget(e):
                raise
            outcomes.append(Outcome(c, error="does not fit the budget"))
        else:
            m = report.metrics
            outcomes.append(Outcome(c, m["step_time"], m["exposed_comm"], int(m["peak_bytes"] + states * m["shard_bytes"])))
        if progress is not None:
            o = outcomes[-1]
            progress(f"autoshard plan: {c.label(ranks_per_node)}: " + (o.error or f"step {fmt_time(o.step_time)}, "
                     f"peak {fmt_bytes(o.peak_bytes)}"))
    fitting = [(o.step_time, o.peak_bytes, i, o) for i, o in enumerate(outcomes) if o.error is None and o.peak_bytes <= limit]
    if not fitting:
        smallest = min((o.peak_bytes for o in outcomes if o.error is None), default=None)
        hint = "" if smallest is None else f"; the smallest candidate peak is {smallest / 2**30:.3f} GiB"
        raise ValueError(f"autoshard.plan: no layout of {world_size} ranks fits memory_budget_gb={memory_budget_gb}{hint}; raise the "
                         "budget, use more ranks, or recompute activations (torch.utils.checkpoint).")
    best = min(fitting, key=lambda t: t[:3])[3].candidate
    return Plan(best.strategy, best.mesh_shape, world_size, ranks_per_node, profile, memory_budget_gb, tuple(outcomes), best.precision)


# -- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``autoshard plan`` flags."""
    parser.description = ("Compile FACTORY's model (unsharded) at --world-size ranks once per sharding layout on a fake world, "
                          "print each one's predicted step and peak, and the fastest that fits --memory-budget-gb.")
    parser.add_argument("factory", metavar="FILE.py:FACTORY", help="a function returning the unsharded model, e.g. "
                        "examples/train_gpt.py:build_model; also MODULE:FACTORY")
    parser.add_argument("--world-size", type=int, required=True, help="ranks of the world to plan for")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node (default 8)")
    parser.add_argument("--memory-budget-gb", type=float, help="per-rank memory the plan must fit, optimizer state included (GiB)")
    parser.add_argument("--profile", default="h100", help="device profile: h100, a100, cpu or a .json from `autoshard calibrate`")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["fp32"],
                        help="precisions a layout may gather and compute in (bf16: gradients reduced in float32)")
    add_input_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="write the plan here (autoshard.Plan.load reads it)")


def run(args: argparse.Namespace) -> int:
    """``autoshard plan``: a progress line per candidate, then the plan's summary."""
    try:
        factory = load_factory("autoshard plan", args.factory)
        make_inputs = input_maker("autoshard plan", args)
        with torch.device("meta"):  # only to read the inputs' shapes off the model's config
            example = make_inputs(factory())
        result = plan(factory, *example, world_size=args.world_size, ranks_per_node=args.ranks_per_node,
                      memory_budget_gb=args.memory_budget_gb, profile=args.profile, precisions=tuple(args.precisions),
                      progress=lambda line: print(line, flush=True))
    except (UsageError, ValueError) as e:
        message = str(e) if str(e).startswith("autoshard") else f"autoshard plan: {e}"
        sys.exit(message.replace("\n", " "))
    print(result.summary())
    if args.json:
        result.save(args.json)
        print(f"wrote {args.json}")
    return 0
