"""What the backend did to one compiled graph: its stages as code, what each pass changed, and
one simulated training step (:mod:`autoshard.cost.simulator`) as a table, an HTML page and a Chrome
trace.

A :class:`Report` is built from the stage copies that :func:`autoshard.compiler.dump.recording` collects
(or that a ``debug_dir`` compile keeps); :func:`autoshard.explain` makes one without a cluster.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import fx

from autoshard.compiler.pipeline import STAGES
from autoshard.cost.cost_model import DeviceProfile, get_profile
from autoshard.cost.liveness import CATEGORIES, parameters_label
from autoshard.cost.simulator import EVENT_KINDS, Event, Simulation, StepAnalysis, simulate
from autoshard.passes.graph_utils import collective_kind, is_exchange, nbytes, parameter_reads, val
from autoshard.passes.schedule import PLAN
from autoshard.runtime.errors import UsageError
from autoshard.runtime.ops import UNSHARD
from autoshard.tools.report.code import node_block
from autoshard.tools.report.page import ComputeGroup, render_html
from autoshard.tools.report.pass_changes import PassSummary, op_label, summarize_pass
from autoshard.tools.report.svg import downsample, peak_positions
from autoshard.tools.units import fmt_bytes, fmt_energy, fmt_time

__all__ = ["STAGES", "ComputeGroup", "PassSummary", "Report", "op_label", "summarize_pass"]


class Report:
    """Stages, pass summaries and the simulated step of one compiled graph (one rank).

    ``stages``: stage name -> graph, in :data:`STAGES` order (copies; never modified).
    ``simulation``: :func:`autoshard.cost.simulator.simulate` of the final forward and backward
    (no backward for an inference graph) on ``profile``, what the planner reads too; ``analysis``
    its :class:`StepAnalysis`, which ``metrics`` and every table, page and trace are read from,
    never recomputed. Build it while the process group the graph
    was compiled on is still initialised: collectives are priced by their group's ranks, and
    its size is ``world_size`` (None without one), which prices the step's energy over all ranks.
    """

    def __init__(
        self, stages: Mapping[str, fx.GraphModule], profile: str | DeviceProfile, *, title: str = "", rank: int | None = None
    ) -> None:
        if "forward" not in stages:
            raise UsageError(f"autoshard.Report: a report needs at least the 'forward' stage, got {sorted(stages)}; "
                             "pass every stage of one compiled graph, 'forward' among them.")
        self.stages = {s: stages[s] for s in STAGES if s in stages}
        self.profile = get_profile(profile)
        self.title = title
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.world_size: int | None = dist.get_world_size() if dist.is_initialized() else None
        self.simulation: Simulation = simulate(self.stages["forward"], self.stages.get("backward"), self.profile)
        self.analysis: StepAnalysis = self.simulation.analysis
        self.passes = self._passes()
        self.metrics = self._metrics()
        self.mixed_cluster_step: Any = None  # explain(cluster=...): the step on a mixed cluster (plan.shares.MixedStep)

    # -- content ---------------------------------------------------------------------------

    def code(self, stage: str) -> str:
        """A stage as readable Python (``GraphModule.print_readable``, as debug_dir writes it)."""
        return self.stages[stage].print_readable(print_output=False, include_stride=True, include_device=True)

    def _passes(self) -> list[PassSummary]:
        found = []
        for side in ("forward", "backward"):
            chain = [s for s in ("captured", "joint", "lowered", f"{side}_bucketed", side) if s in self.stages]
            for a, b in zip(chain, chain[1:]):
                if side == "backward" and b in ("joint", "lowered"):
                    continue  # shared with the forward chain
                found.append(summarize_pass(a, b, self.stages[a], self.stages[b]))
        return found

    def _parameters(self) -> tuple[int | None, int | None, int]:
        """(parameters, shard bytes on this rank, sharded tensors) from the captured graph's
        annotations, each parameter counted once however many modules use it (tied weights)."""
        captured = self.stages.get("captured")
        if captured is None:
            return None, None, 0
        seen: dict[Any, tuple[int, int]] = {}
        for op, a in parameter_reads(captured.graph):
            unshard = op == UNSHARD
            local = a["shard" if unshard else "tensor"]  # the leaf: one graph input per parameter
            value = local.meta.get("example_value", local.meta.get("val")) if isinstance(local, fx.Node) else None
            if value is None:
                return None, None, 0
            rows = a["dim0"] if unshard else None
            full = value.numel() if rows is None else rows * math.prod(value.shape[1:])
            seen[local] = (int(full), int(value.numel() * value.element_size()))
        return sum(f for f, _ in seen.values()), sum(b for _, b in seen.values()), len(seen)

    def _metrics(self) -> dict[str, Any]:
        a = self.analysis
        params, shard_bytes, tensors = self._parameters()
        events = self.collectives()
        return {
            "parameters": params,
            "sharded_tensors": tensors,
            "shard_bytes": shard_bytes,
            "forward_buckets": sum(1 for e in events if e.stage == "forward"),
            "backward_buckets": sum(1 for e in events if e.stage == "backward"),
            "collectives": {k: sum(1 for e in events if e.kind == k) for k in EVENT_KINDS},
            "comm_bytes": dict(a.comm_bytes),
            "step_time": a.step_time,
            "compute_time": a.compute_time,
            "comm_time": a.comm_time,
            "exposed_comm": a.exposed_comm,
            "overlap_ratio": a.overlap_ratio,
            "peak_bytes": a.peak_bytes,
            "peak_gathered_bytes": a.peak_gathered_bytes,
            "bytes_per_parameter": a.peak_bytes / params if params else None,
            "step_lower_bound": a.step_lower_bound,
            "step_gap": a.step_time / a.step_lower_bound - 1 if a.step_lower_bound else 0.0,
            "memory_lower_bound": a.memory_lower_bound,
            "memory_gap": a.peak_bytes / a.memory_lower_bound - 1 if a.memory_lower_bound else 0.0,
            # Joules per step: this rank's, and every rank's (the same work each) where the world is known.
            "energy_j": a.energy_j,
            "energy_j_all_ranks": a.energy_j * self.world_size if a.energy_j is not None and self.world_size else None,
        }

    def collectives(self) -> list[Event]:
        """The collective events of the simulated step, in program order."""
        return [e for e in self.analysis.timeline if e.lane != "compute"]

    def compute_groups(self) -> list[ComputeGroup]:
        """The compute events merged into :class:`ComputeGroup` s, in order: what the page and
        the trace draw, so a graph of tens of thousands of nodes stays a few hundred items."""
        nodes = {(s, n.name): n for s in ("forward", "backward") if s in self.stages for n in self.stages[s].graph.nodes}
        runs: list[list[Event]] = []
        for e in self.analysis.timeline:
            if e.lane != "compute":
                runs.append([])  # a collective is issued here: a new group starts
            elif runs and runs[-1] and runs[-1][-1].stage == e.stage and e.start <= runs[-1][-1].end:
                runs[-1].append(e)
            else:
                runs.append([e])
        groups = []
        for run in filter(None, runs):
            blocks = Counter(b for e in run if (b := node_block(nodes.get((e.stage, e.name)))))
            label = blocks.most_common(1)[0][0] if blocks else ""
            groups.append(ComputeGroup(run[0].stage, run[0].start, run[-1].end, tuple(run), label))
        return groups

    def backward_start(self) -> float | None:
        """Simulated time at which the backward graph starts (None without one)."""
        if "backward" not in self.stages:
            return None
        return self.analysis.memory_curve[len(self.stages["forward"].graph.nodes)][0]

    # -- outputs ---------------------------------------------------------------------------

    def summary_rows(self) -> list[tuple[str, str]]:
        """The rows of :meth:`summary`: (quantity, value as text)."""
        m, a = self.metrics, self.analysis
        step = a.step_time or 1.0
        by_kind = lambda d, f: ", ".join(f"{k} {f(v)}" for k, v in d.items() if v) or "none"  # noqa: E731
        return [
            ("parameters", f"{m['parameters']:,}" if m["parameters"] is not None else "unknown"),
            ("shards (this rank)", f"{m['sharded_tensors']} tensors, "
                f"{fmt_bytes(m['shard_bytes'])}" if m["shard_bytes"] is not None else "unknown"),
            ("buckets (collectives)", f"forward {m['forward_buckets']}, backward {m['backward_buckets']}"),
            ("collectives per step", f"{sum(m['collectives'].values())} ({by_kind(m['collectives'], str)})"),
            ("bytes per step", f"{fmt_bytes(sum(m['comm_bytes'].values()))} ({by_kind(m['comm_bytes'], fmt_bytes)})"),
            *self._compression_rows(),
            ("step time (predicted)", fmt_time(a.step_time)),
            ("compute time", fmt_time(a.compute_time)),
            ("communication time", fmt_time(a.comm_time)),
            ("exposed communication", f"{fmt_time(a.exposed_comm)} ({100 * a.exposed_comm / step:.1f}% of step)"),
            *self._exposed_rows(),
            ("overlap ratio", f"{a.overlap_ratio:.3f}"),
            *self._energy_rows(),
            ("peak memory per rank", fmt_bytes(a.peak_bytes) + (f" ({p.stage}, at {fmt_time(p.time)})" if (p := a.memory_peak) else "")),
            *self._peak_rows(),
            *self._budget_rows(),
            ("peak gathered parameters", fmt_bytes(a.peak_gathered_bytes)),
            ("bytes per parameter (GB per billion)", f"{m['bytes_per_parameter']:.3g}" if m["bytes_per_parameter"] else "unknown"),
            ("step lower bound", f"{fmt_time(a.step_lower_bound)} (gap {100 * m['step_gap']:.1f}%)"),
            ("memory lower bound", f"{fmt_bytes(a.memory_lower_bound)} (gap {100 * m['memory_gap']:.1f}%)"),
            *self._mixed_cluster_rows(),
        ]

    def _mixed_cluster_rows(self) -> list[tuple[str, str]]:
        """On a mixed cluster: the step with planned batch shares and, per rank type, its share,
        busy and waiting time, utilisation and peak; the utilisation variance across types."""
        cluster_step = self.mixed_cluster_step
        if cluster_step is None:
            return []
        step, world = cluster_step.step_time or 1.0, sum(t.ranks for t in cluster_step.types)
        util = [t.busy / step for t in cluster_step.types]
        mean = sum(util) / len(util)
        rows = [("mixed cluster: step (planned shares)", fmt_time(cluster_step.step_time))]
        rows += [(f"  {t.name} ({t.ranks} ranks)", f"share {t.share:.3%} per rank ({t.share * world:.2f}x even), busy "
                  f"{fmt_time(t.busy)}, waiting {fmt_time(t.wait)}, utilisation {u:.1%}, peak {fmt_bytes(t.peak_bytes)}"
                  + ("" if t.limit_bytes is None else f" of {fmt_bytes(t.limit_bytes)}")) for t, u in zip(cluster_step.types, util)]
        return rows + [("utilisation variance across rank types", f"{sum((u - mean) ** 2 for u in util) / len(util):.4f}")]

    def _compression_rows(self) -> list[tuple[str, str]]:
        """Collectives that move 8-bit packed values (``autoshard.Compression``'s int8 or fp8,
        both moved as int8 bytes): how many per step and their bytes, gathers and reductions
        apart; none without compression."""
        found = {"gathers": Counter(), "reductions": Counter()}
        for side in ("forward", "backward"):
            for node in self.stages[side].graph.nodes if side in self.stages else ():
                kind = "gathers" if collective_kind(node) == "all_gather" else "reductions" if is_exchange(node) else None
                if kind and isinstance(node.args[0], fx.Node) and val(node.args[0]).dtype == torch.int8:
                    found[kind].update(n=1, bytes=nbytes(node))
        text = [f"8-bit {k} {c['n']} ({fmt_bytes(c['bytes'])})" for k, c in found.items() if c]
        return [("compressed collectives per step", ", ".join(text))] if text else []

    def _energy_rows(self) -> list[tuple[str, str]]:
        """Energy per step, per rank and over all ranks; none where the profile has no power figures."""
        m = self.metrics
        if m["energy_j"] is None:
            return []
        over = f", {fmt_energy(m['energy_j_all_ranks'])} over {self.world_size} ranks" if m["energy_j_all_ranks"] is not None else ""
        return [("energy per step", f"{fmt_energy(m['energy_j'])} per rank{over}")]

    def _exposed_rows(self, top: int = 3) -> list[tuple[str, str]]:
        """The collectives that added the most step time, worst first."""
        step = self.analysis.step_time or 1.0
        worst = sorted((e for e in self.collectives() if e.exposed > 0), key=lambda e: -e.exposed)[:top]
        # A collective that moves no parameter (tensor parallelism's partial sums) moves activations.
        moved = [parameters_label(e.params) if e.params else f"activations ({e.name})" for e in worst]
        return [("most exposed collectives" if i == 0 else "", f"{fmt_time(e.exposed)} ({100 * e.exposed / step:.1f}% of step): "
                 f"{e.stage} {e.kind} of {what}") for i, (e, what) in enumerate(zip(worst, moved))]

    def _peak_rows(self, top: int = 3) -> list[tuple[str, str]]:
        """What is alive at the memory peak: bytes per category, largest first, then the
        largest tensors and who they belong to."""
        peak, total = self.analysis.memory_peak, self.analysis.peak_bytes or 1
        if peak is None:
            return []
        rows = [(f"at the peak: {CATEGORIES[c]}", f"{fmt_bytes(b)} ({100 * b / total:.1f}%)")
                for c, b in sorted(peak.by_category.items(), key=lambda kv: -kv[1]) if b]
        rows += [("at the peak: largest" if i == 0 else "", f"{fmt_bytes(t.nbytes)} {CATEGORIES[t.category]}"
                  f"{': ' + t.owner if t.owner else ''} ({t.stage} {t.node})") for i, t in enumerate(peak.largest[:top])]
        return rows

    def _budget_rows(self) -> list[tuple[str, str]]:
        """The schedule's memory plan per graph: its budget (given, or FSDP2's peak by
        default), its predicted peak with optimizer state, and what the budget changed."""
        rows = []
        for side in ("forward", "backward"):
            plan = self.stages[side].meta.get(PLAN) if side in self.stages else None
            if plan is None or plan.budget_bytes is None:
                continue
            forced = "; ".join(plan.forced) if plan.forced else "nothing"
            rows.append((f"memory plan ({side})", f"budget {fmt_bytes(plan.budget_bytes)}, predicted peak "
                         f"{fmt_bytes(plan.peak_bytes)} with optimizer state, smallest that fits "
                         f"{fmt_bytes(plan.smallest_bytes or 0)}; the budget changed: {forced}"))
        return rows

    def summary(self) -> str:
        """A plain-text table of :meth:`summary_rows`, headed by title, rank and profile."""
        head = f"{self.title + ': ' if self.title else ''}rank {self.rank}, profile {self.profile.name} (predicted by the simulator)"
        return head + "\n" + tabulate(self.summary_rows(), headers=("quantity", "value"))

    def chrome_trace(self) -> dict:
        """The simulated step as Chrome trace events (Perfetto, chrome://tracing): one "X"
        event per collective (args: kind, bytes, exposed time, parameters), per compute group
        and per exposed interval (on the compute lane), stage spans, a "C" memory counter and
        one stacked by category; times in microseconds; pid is the rank, tid a lane."""
        us = 1e6
        lanes = ["stage", "compute", *sorted({e.lane for e in self.collectives()})]
        tid = {lane: i for i, lane in enumerate(lanes)}
        pid = self.rank
        title = f"rank {pid}: simulated step, profile {self.profile.name}"
        events: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": title}}]
        for lane, t in tid.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": lane}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": t, "args": {"sort_index": t}})
        bw = self.backward_start()
        step = self.analysis.step_time
        spans = [("forward", 0.0, step)] if bw is None else [("forward", 0.0, bw), ("backward", bw, step)]
        for name, start, end in spans:
            events.append(
                {"ph": "X", "cat": "stage", "name": name, "pid": pid, "tid": tid["stage"], "ts": start * us, "dur": (end - start) * us}
            )
        for g in self.compute_groups():
            ops = Counter(e.name.rstrip("0123456789").rstrip("_") for e in g.events)
            events.append({
                "ph": "X", "cat": "compute", "name": f"{g.stage} {g.label}".strip(), "pid": pid, "tid": tid["compute"],
                "ts": g.start * us, "dur": (g.end - g.start) * us,
                "args": {"nodes": len(g.events), "first": g.events[0].name, "last": g.events[-1].name, "ops": dict(ops.most_common(8))},
            })
        for e in self.collectives():
            events.append({
                "ph": "X", "cat": "collective", "name": e.kind, "pid": pid, "tid": tid[e.lane],
                "ts": e.start * us, "dur": (e.end - e.start) * us,
                "args": {"node": e.name, "stage": e.stage, "kind": e.kind, "bytes": e.nbytes, "exposed_us": e.exposed * us,
                         "params": list(e.params)},
            })
        curve, by_category = self.analysis.memory_curve, self.analysis.memory_by_category
        for t, live in downsample(curve, 4000):
            events.append({"ph": "C", "name": "memory", "pid": pid, "ts": t * us, "args": {"live MiB": live / 2**20}})
        for i in peak_positions(curve, 2000):  # stacked in Perfetto: one series per category
            events.append({"ph": "C", "name": "memory by category", "pid": pid, "ts": curve[i][0] * us,
                           "args": {CATEGORIES[c]: v[i] / 2**20 for c, v in by_category.items() if any(v)}})
        for s in self.analysis.stalls:
            events.append({"ph": "X", "cat": "exposed", "name": f"exposed: {s.stage} {s.name}", "pid": pid, "tid": tid["compute"],
                           "ts": s.start * us, "dur": (s.end - s.start) * us})
        return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"title": self.title, "profile": self.profile.name}}

    def save_chrome_trace(self, path: str | Path) -> None:
        """Write :meth:`chrome_trace` as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.chrome_trace()))

    def html(self, stage_files: frozenset[str] = frozenset()) -> str:
        """One self-contained page (inline SVG and CSS, no script, nothing fetched): summary,
        timeline, memory by category, buckets by exposed time, passes and the final stages'
        code (the others are linked when in ``stage_files``: written as ``<stage>.py`` beside it)."""
        return render_html(self, frozenset(stage_files))

    def save_html(self, path: str | Path) -> None:
        """Write :meth:`html` to ``path``, linking the stage files already beside it."""
        path = Path(path)
        path.write_text(self.html(frozenset(s for s in self.stages if (path.parent / f"{s}.py").is_file())))

    def save(self, folder: str | Path) -> None:
        """Write ``report.html``, ``trace.json`` and ``summary.txt`` into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.save_html(folder / "report.html")
        self.save_chrome_trace(folder / "trace.json")
        (folder / "summary.txt").write_text(self.summary() + "\n\n" + "\n".join(p.text() for p in self.passes) + "\n")


def write_report(stages: Mapping[str, fx.GraphModule], profile: str | DeviceProfile, folder: Path) -> None:
    """The backend's debug_dir report (registered with
    :func:`autoshard.compiler.dump.register_report_writer` by ``autoshard/__init__.py``)."""
    Report(stages, profile, title=str(folder)).save(folder)


def timeline(stages: Mapping[str, fx.GraphModule], profile: str | DeviceProfile) -> dict:
    """The simulated step as Chrome trace events, for the structured trace (registered with
    :func:`autoshard.compiler.logs.register_timeline` by ``autoshard/__init__.py``)."""
    return Report(stages, profile).chrome_trace()
