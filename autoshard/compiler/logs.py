"""What the backend decides, where PyTorch users look: Python loggers (``TORCH_LOGS=autoshard``),
artifacts of the structured trace (``TORCH_TRACE``, read by tlparse) and compile phases in
``torch._dynamo.utils.compile_times()``.

Loggers, all under ``autoshard.compiler``, one INFO line per compiled forward or backward graph:

- ``autoshard.compiler``: collectives before and after bucketing, and the plan signature
  (:func:`autoshard.compiler.consistency.plan_signature`, the same on every rank);
- ``autoshard.compiler.buckets``: each bucket's kind and size, and the cap they were made for;
- ``autoshard.compiler.schedule``: the schedule plan (prefetch distances, reductions in flight,
  predicted peak and step time, the budget and what it forced).

Nothing is computed or formatted unless a logger is enabled or a trace is written.

Artifacts (only while ``TORCH_TRACE`` writes a trace): ``autoshard_<stage>`` (each stage's graph
as code, as ``debug_dir`` writes it), ``autoshard_plan`` (what the loggers say, as JSON) and
``autoshard_timeline`` (the simulated step as a Chrome trace, as ``debug_dir``'s ``trace.json``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping

from torch import fx

from autoshard._compat import compile_phase, register_torch_log, structured_trace_on, trace_artifact
from autoshard.compiler.consistency import plan_signature
from autoshard.passes.graph_utils import PARAMS, collective_kind, nbytes, tensor_bytes, val
from autoshard.passes.schedule import PLAN

if TYPE_CHECKING:
    from autoshard.cost.cost_model import DeviceProfile

log = logging.getLogger("autoshard.compiler")
buckets_log = logging.getLogger("autoshard.compiler.buckets")
schedule_log = logging.getLogger("autoshard.compiler.schedule")
LOGS = (log, buckets_log, schedule_log)

register_torch_log("autoshard", "autoshard")  # TORCH_LOGS=autoshard, TORCH_LOGS=+autoshard

PHASE = "autoshard.{}"  # compile_times() keys: autoshard.capture, autoshard.joint_passes, autoshard.forward_passes, ...


def phase(name: str) -> contextlib.AbstractContextManager:
    """Time the block as ``autoshard.<name>`` in PyTorch's compile-time summary."""
    return compile_phase(PHASE.format(name))


Timeline = Callable[[Mapping[str, fx.GraphModule], "str | DeviceProfile"], dict]
# What makes the predicted timeline (Chrome trace events) from a graph's stages: set by
# autoshard/__init__.py (the report's), so the compiler never imports the tools.
TIMELINES: list[Timeline] = []


def register_timeline(timeline: Timeline) -> None:
    if timeline not in TIMELINES:
        TIMELINES.append(timeline)


_graph_ids = itertools.count()


class CompileLog:
    """The logs and trace artifacts of one graph Dynamo handed the backend (its forward and
    backward share its number)."""

    def __init__(self) -> None:
        self.graph = next(_graph_ids)
        self.tracing = structured_trace_on()

    def wants_copies(self) -> bool:
        """Whether the stages must be kept (for the timeline)."""
        return self.tracing and bool(TIMELINES)

    def writing(self, write: Callable[[str, fx.GraphModule], None]) -> Callable[[str, fx.GraphModule], None]:
        """``write`` (a stage writer), then the stage's graph as an artifact of the trace."""
        if not self.tracing:
            return write

        def write_and_trace(stage: str, gm: fx.GraphModule) -> None:
            write(stage, gm)
            code = lambda: gm.print_readable(print_output=False, include_stride=True, include_device=True)  # noqa: E731
            trace_artifact(f"autoshard_{stage}", "string", code)

        return write_and_trace

    def graph_done(self, side: str, gm: fx.GraphModule, bucket_mb: float | None) -> None:
        """Log (and trace) what was decided for the final ``side`` graph ``gm``."""
        if not self.tracing and not any(lg.isEnabledFor(logging.INFO) for lg in LOGS):
            return
        plan = describe(gm, side, bucket_mb)
        plan["graph"] = self.graph
        if log.isEnabledFor(logging.INFO):
            counts = ", ".join(f"{k} {n} -> {plan['collectives_after'][k]}" for k, n in plan["collectives_before"].items())
            log.info("graph %d %s: %d collectives -> %d after bucketing (%s); plan signature %s", self.graph, side,
                     sum(plan["collectives_before"].values()), len(plan["buckets"]), counts or "none", plan["signature"])
        if buckets_log.isEnabledFor(logging.INFO):
            sizes = ", ".join(f"{b['kind']} {_mib(b['bytes'])}" for b in plan["buckets"])
            cap = "none: one per block" if bucket_mb is None else f"{bucket_mb:.3g} MiB at most"
            buckets_log.info("graph %d %s: %d buckets (size cap %s): %s", self.graph, side, len(plan["buckets"]), cap, sizes or "none")
        if schedule_log.isEnabledFor(logging.INFO) and plan["schedule"] is not None:
            schedule_log.info("graph %d %s: %s", self.graph, side, _schedule_words(plan["schedule"]))
        if self.tracing:
            trace_artifact("autoshard_plan", "json", lambda: plan)

    def timeline(self, stages: Mapping[str, fx.GraphModule], profile: str | DeviceProfile) -> None:
        """Trace the predicted step of the graph whose stages are ``stages``."""
        if not self.wants_copies() or "forward" not in stages:
            return
        for make in TIMELINES:
            try:
                events = make(stages, profile)
            except Exception as e:  # noqa: BLE001  a trace must not stop the compile it describes
                warnings.warn(f"autoshard: no timeline in the trace: {type(e).__name__}: {e}", stacklevel=2)
                continue
            trace_artifact("autoshard_timeline", "json", lambda events=events: events)


def describe(gm: fx.GraphModule, side: str, bucket_mb: float | None) -> dict[str, Any]:
    """What the loggers report of a final graph, as JSON-ready data."""
    buckets, before, after = [], {}, {}
    for node in gm.graph.nodes:
        kind = collective_kind(node) if node.op == "call_function" else None
        if kind is None:
            continue
        params = node.meta.get(PARAMS) or ()
        moved = max(nbytes(node), tensor_bytes(fx.node.map_aggregate(node.args[0], val)))
        buckets.append({"kind": kind, "bytes": moved, "params": len(params)})
        before[kind] = before.get(kind, 0) + max(len(params), 1)  # one collective per parameter before bucketing
        after[kind] = after.get(kind, 0) + 1
    plan = gm.meta.get(PLAN)
    return {
        "side": side,
        "signature": plan_signature(gm),
        "bucket_mb": bucket_mb,
        "collectives_before": before,
        "collectives_after": after,
        "buckets": buckets,
        "schedule": dataclasses.asdict(plan) if plan is not None else None,
    }


def _mib(n: float | None) -> str:
    return "none" if n is None else f"{n / 2**20:.3g} MiB"


def _schedule_words(s: dict[str, Any]) -> str:
    budget = "no budget" if s["budget_bytes"] is None else f"budget {_mib(s['budget_bytes'])}"
    forced = "; ".join(s["forced"]) or "nothing"
    return (f"prefetch distances {list(s['distances'])}, {s['reduces_in_flight']} reductions in flight; predicted peak "
            f"{_mib(s['peak_bytes'])}, step {s['step_time'] * 1e3:.3g} ms; {budget} (reference {_mib(s['reference_bytes'])}, "
            f"smallest {_mib(s['smallest_bytes'])}); the budget forced {forced}")

