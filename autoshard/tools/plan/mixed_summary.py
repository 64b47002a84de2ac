"""What a plan for a mixed cluster adds to :meth:`autoshard.Plan.summary`: each candidate's
step with its planned batch shares next to the single-type plan's (every rank as the slowest,
even shares),
and for the chosen layout, per rank type: share of the batch, busy and waiting time,
utilisation, peak against its memory; the utilisation variance across types and the
throughput per dollar."""
from __future__ import annotations

import math
from typing import Any

from autoshard.tools.units import fmt_bytes, fmt_time


def single_type_outcome(plan: Any) -> Any:
    """The single-type plan's outcome: what the planner picks for the cluster taken as all of its
    slowest type, the fastest at even shares under the smallest memory (ties: smaller peak, then
    candidate order) of the candidates it compiles (one all-reduce per block: merged ones are the
    mixed cluster's own trial, :func:`autoshard.tools.plan.plan.merge_all_reduces`)."""
    limit = math.inf if plan.memory_budget_gb is None else plan.memory_budget_gb * 2**30
    fitting = [(o.step_time, o.peak_bytes, i, o) for i, o in enumerate(plan.outcomes)
               if o.error is None and o.peak_bytes <= limit and o.candidate.all_reduce_blocks == 1]
    return min(fitting, key=lambda t: t[:3])[3] if fitting else None


def utilisation(o: Any) -> list[float]:
    """Each rank type's busy fraction of the mixed step."""
    return [t.busy / o.mixed_step if o.mixed_step else 0.0 for t in o.types]


def variance(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def per_dollar(plan: Any, step_time: float) -> tuple[float, str] | None:
    """Tokens (or steps, without token ids) per dollar at ``step_time``; None without prices."""
    cluster = plan.cluster
    if cluster is None or any(g.price_per_hour is None for g in cluster.nodes):
        return None
    dollars_per_s = sum(g.price_per_hour * g.ranks for g in cluster.nodes) / 3600
    per_step = plan.tokens_per_step or 1
    return per_step / step_time / dollars_per_s, ("tokens" if plan.tokens_per_step else "steps")


def mixed_summary(plan: Any) -> str:
    cluster, chosen, base = plan.cluster, plan.chosen, single_type_outcome(plan)
    slow = cluster.nodes[cluster.slowest()].name
    lines = [f"on the mixed cluster {cluster.label}: each candidate with its planned batch shares "
             f"(vs every rank as {slow}, even shares)"]
    for o in plan.outcomes:
        if o.mixed_step is None:
            continue
        mark = "* " if o is chosen else "  "
        fit = "" if o.mixed_fits else "  over a type's memory"
        lines.append(f"{mark}{o.candidate.label(plan.ranks_per_node):40s} {fmt_time(o.mixed_step):>10s} "
                     f"(as all {slow}: {fmt_time(o.step_time)}){fit}")
    lines.append(f"{'rank type':10s} {'ranks':>6s} {'share/rank':>10s} {'x even':>7s} {'state/rank':>10s} {'busy':>10s} "
                 f"{'waiting':>10s} {'util':>6s} {'peak':>10s} {'memory':>10s}")
    for t, u in zip(chosen.types, utilisation(chosen)):
        memory = "-" if t.limit_bytes is None else fmt_bytes(t.limit_bytes)
        state = t.state_share if t.state_share is not None else 1 / plan.world_size  # of the parameters, grads, optimizer
        lines.append(f"{t.name:10s} {t.ranks:6d} {t.share:10.3%} {t.share * plan.world_size:7.2f} {state:10.3%} "
                     f"{fmt_time(t.busy):>10s} {fmt_time(t.wait):>10s} {u:6.1%} {fmt_bytes(t.peak_bytes):>10s} {memory:>10s}")
    if plan.state_shares is not None:
        lines.append("state shares (parameters, gradients, optimizer state; even shards do not fit every type): "
                     + ", ".join(f"{s:.3f}" for s in plan.state_shares) + " by rank; shards padded to the widest in collectives")
    lines.append(f"utilisation variance across rank types: {variance(utilisation(chosen)):.4f}")
    if base is not None:
        lines.append(f"single-type plan, all {slow} ({base.candidate.label(plan.ranks_per_node)}, even shares): "
                     f"{fmt_time(base.step_time)}; planned: {fmt_time(chosen.mixed_step)} "
                     f"({chosen.mixed_step / base.step_time:.2f}x)")
    dollars = per_dollar(plan, chosen.mixed_step)
    if dollars is not None:
        line = f"throughput per dollar: {dollars[0]:.4g} {dollars[1]}/$"
        if base is not None:
            line += f" (even shares as all {slow}: {per_dollar(plan, base.step_time)[0]:.4g})"
        lines.append(line)
    return "\n".join(lines)
