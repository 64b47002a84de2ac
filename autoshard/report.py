"""What the backend did to one compiled graph: its stages as code, what each pass changed, and
one simulated training step (:mod:`autoshard.analysis`) as a table, an HTML page and a Chrome
trace.

A :class:`Report` is built from the stage copies that :func:`autoshard.dump.recording` collects
(or that a ``debug_dir`` compile keeps); :func:`autoshard.explain` makes one without a cluster.
"""
from __future__ import annotations

import html
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch.distributed as dist
from tabulate import tabulate
from torch import fx

from autoshard.passes.bucket import block_of
from autoshard.passes.graph_utils import PARAMS

from ._compat import to_local_source
from .analysis import Event, StepAnalysis, analyze
from .cost_model import COLLECTIVE_KINDS, DeviceProfile, collective_of, get_profile

# The stages the backend writes, in pipeline order (autoshard/backend.py). Inference graphs
# have no joint, lowered or backward stages; the "none" and "inductor" schedules no *_bucketed.
STAGES = ("captured", "joint", "lowered", "forward_bucketed", "forward", "backward_bucketed", "backward")


def _what(before: str, after: str) -> str:
    """What the backend does between two stages (autoshard/backend.py)."""
    if after == "joint":
        return "AOT autograd: traced to ATen, forward and backward in one joint graph"
    if after == "lowered":
        return "lower: shared parameters merged, annotations replaced by collectives, last bucket kept gathered"
    steps = {"captured": ["AOT autograd: traced to ATen (inference: no backward)", "lower"], "lowered": ["partition"]}.get(before, [])
    if after.endswith("_bucketed"):
        steps.append("bucket: per-parameter collectives merged into flat ones")
    else:
        steps.append("schedule: prefetch and reorder" if before.endswith("_bucketed") else "the schedule option's reordering")
    return ", then ".join(steps)


_MAX_CODE_CHARS = 500_000  # per stage in the HTML page; an 8B model's joint graph is tens of MB


def op_label(node: fx.Node) -> str:
    """A node's operation: ``aten.mm.default``, ``getitem``, ``.to_local`` (a method),
    ``module:blocks.0.fc`` or the node kind (``placeholder``, ``output``, ``get_attr``)."""
    if node.op == "call_function":
        return str(node.target) if hasattr(node.target, "overloadpacket") else getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_module":
        return f"module:{node.target}"
    return node.op


def _moved(before: list[str], after: list[str]) -> int:
    """Fewest nodes to move to turn ``before``'s order of the shared names into ``after``'s:
    those outside a longest increasing subsequence of their new positions."""
    where = {name: i for i, name in enumerate(after)}
    positions = [where[name] for name in before if name in where]
    tails: list[int] = []  # patience sorting: tails[k] = smallest tail of an increasing run of k+1
    for p in positions:
        lo, hi = 0, len(tails)
        while lo < hi:
            mid = (lo + hi) // 2
            if tails[mid] < p:
                lo = mid + 1
            else:
                hi = mid
        tails[lo:lo + 1] = [p]
    return len(positions) - len(tails)


@dataclass(frozen=True)
class PassSummary:
    """What changed from stage ``before`` to stage ``after``.

    added / removed: node counts by :func:`op_label` (multiset difference); moved: surviving
    nodes (same name in both) that changed relative order, counted as the fewest moves;
    collectives: per kind, ``(collectives, parameters they move)`` in ``after`` when it is
    the first bucketed (or final) stage; a parameter count above the collective count means
    buckets were formed.
    """

    before: str
    after: str
    what: str
    nodes_before: int
    nodes_after: int
    added: dict[str, int]
    removed: dict[str, int]
    moved: int
    collectives: dict[str, tuple[int, int]]

    def text(self, top: int = 4) -> str:
        def ops(counts: dict[str, int]) -> str:
            items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
            shown = ", ".join(f"{k.removeprefix('aten.').removeprefix('_c10d_functional.')} x{v}" for k, v in items[:top])
            more = f", ... {len(items) - top} more ops" if len(items) > top else ""
            return f"{sum(counts.values())} ({shown}{more})" if counts else "0"

        parts = [
            f"{self.before} -> {self.after}: {self.what}.",
            f"nodes {self.nodes_before} -> {self.nodes_after}; added {ops(self.added)}; removed {ops(self.removed)}; moved {self.moved}",
        ]
        for kind, (n, params) in self.collectives.items():
            parts.append(f"{kind}: {params} parameters in {n} collectives" + (" (bucketed)" if params > n else ""))
        return " ".join(parts[:1]) + " " + "; ".join(parts[1:]) + "."


def _collective_counts(gm: fx.GraphModule) -> dict[str, tuple[int, int]]:
    counts: dict[str, list[int]] = {}
    for node in gm.graph.nodes:
        if (c := collective_of(node)) is not None:
            entry = counts.setdefault(c.kind, [0, 0])
            entry[0] += 1
            # Lowering names one parameter per collective; bucketing concatenates the names.
            entry[1] += max(1, len(node.meta.get(PARAMS, ())))
    return {k: (v[0], v[1]) for k, v in counts.items()}


def summarize_pass(before: str, after: str, a: fx.GraphModule, b: fx.GraphModule) -> PassSummary:
    """The :class:`PassSummary` of going from graph ``a`` (stage ``before``) to ``b``."""
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    ca, cb = Counter(map(op_label, na)), Counter(map(op_label, nb))
    first_partitioned = after.endswith("_bucketed") or before in ("captured", "lowered")
    return PassSummary(
        before, after, _what(before, after),
        len(na), len(nb), dict(cb - ca), dict(ca - cb),
        _moved([n.name for n in na], [n.name for n in nb]),
        _collective_counts(b) if first_partitioned and after not in ("joint", "lowered") else {},
    )


@dataclass(frozen=True)
class ComputeGroup:
    """Consecutive compute nodes of one stage that ran back to back: no collective issued and
    no wait stalled compute between them. ``label``: the model block most of them come from."""

    stage: str
    start: float
    end: float
    events: tuple[Event, ...]
    label: str


def _block(node: fx.Node | None) -> str | None:
    stack = node.meta.get("nn_module_stack") if node is not None else None
    if not stack:
        return None
    path = str(list(stack.values())[-1][0]).removeprefix("L['self']").lstrip(".")
    return block_of(path + ".x") or path.split(".")[0] or None


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _fmt_time(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.4g} {unit}"
    return f"{s * 1e9:.4g} ns"


class Report:
    """Stages, pass summaries and the simulated step of one compiled graph (one rank).

    ``stages``: stage name -> graph, in :data:`STAGES` order (copies; never modified).
    ``analysis``: :func:`autoshard.analysis.analyze` of the final forward and backward (no
    backward for an inference graph) on ``profile``; ``metrics`` and every table, page and
    trace are read from it, never recomputed. Build it while the process group the graph
    was compiled on is still initialised: collectives are priced by their group's ranks.
    """

    def __init__(self, stages: Mapping[str, fx.GraphModule], profile: str | DeviceProfile, *, title: str = "", rank: int | None = None) -> None:
        if "forward" not in stages:
            raise ValueError(f"a report needs at least the 'forward' stage; got {sorted(stages)}.")
        self.stages = {s: stages[s] for s in STAGES if s in stages}
        self.profile = get_profile(profile)
        self.title = title
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.analysis: StepAnalysis = analyze(self.stages["forward"], self.stages.get("backward"), self.profile)
        self.passes = self._passes()
        self.metrics = self._metrics()

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
        for node in captured.graph.nodes:
            name = str(node.target)
            if node.op != "call_function" or name not in ("autoshard.unshard.default", "autoshard.replicate.default"):
                continue
            local = node.args[0]
            source = to_local_source(local) if isinstance(local, fx.Node) else None
            key = local if source is None else source
            value = local.meta.get("example_value", local.meta.get("val")) if isinstance(local, fx.Node) else None
            if value is None:
                return None, None, 0
            rows = node.args[3] if name == "autoshard.unshard.default" else None
            full = value.numel() if rows is None else rows * math.prod(value.shape[1:])
            seen[key] = (int(full), int(value.numel() * value.element_size()))
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
            "collectives": {k: sum(1 for e in events if e.kind == k) for k in COLLECTIVE_KINDS},
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
            blocks = Counter(b for e in run if (b := _block(nodes.get((e.stage, e.name)))))
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
            ("shards (this rank)", f"{m['sharded_tensors']} tensors, {_fmt_bytes(m['shard_bytes'])}" if m["shard_bytes"] is not None else "unknown"),
            ("buckets (collectives)", f"forward {m['forward_buckets']}, backward {m['backward_buckets']}"),
            ("collectives per step", f"{sum(m['collectives'].values())} ({by_kind(m['collectives'], str)})"),
            ("bytes per step", f"{_fmt_bytes(sum(m['comm_bytes'].values()))} ({by_kind(m['comm_bytes'], _fmt_bytes)})"),
            ("step time (predicted)", _fmt_time(a.step_time)),
            ("compute time", _fmt_time(a.compute_time)),
            ("communication time", _fmt_time(a.comm_time)),
            ("exposed communication", f"{_fmt_time(a.exposed_comm)} ({100 * a.exposed_comm / step:.1f}% of step)"),
            ("overlap ratio", f"{a.overlap_ratio:.3f}"),
            ("peak memory per rank", _fmt_bytes(a.peak_bytes)),
            ("peak gathered parameters", _fmt_bytes(a.peak_gathered_bytes)),
            ("bytes per parameter (GB per billion)", f"{m['bytes_per_parameter']:.3g}" if m["bytes_per_parameter"] else "unknown"),
            ("step lower bound", f"{_fmt_time(a.step_lower_bound)} (gap {100 * m['step_gap']:.1f}%)"),
            ("memory lower bound", f"{_fmt_bytes(a.memory_lower_bound)} (gap {100 * m['memory_gap']:.1f}%)"),
        ]

    def summary(self) -> str:
        """A plain-text table of :meth:`summary_rows`, headed by title, rank and profile."""
        head = f"{self.title + ': ' if self.title else ''}rank {self.rank}, profile {self.profile.name} (predicted by the simulator)"
        return head + "\n" + tabulate(self.summary_rows(), headers=("quantity", "value"))

    def chrome_trace(self) -> dict:
        """The simulated step as Chrome trace events (Perfetto, chrome://tracing): one "X"
        event per collective (args: kind, bytes, parameters) and per compute group, stage
        spans, a "C" memory counter; times in microseconds; pid is the rank, tid a lane."""
        us = 1e6
        lanes = ["stage", "compute", *sorted({e.lane for e in self.collectives()})]
        tid = {lane: i for i, lane in enumerate(lanes)}
        pid = self.rank
        events: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {pid}: simulated step, profile {self.profile.name}"}}]
        for lane, t in tid.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": lane}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": t, "args": {"sort_index": t}})
        bw = self.backward_start()
        spans = [("forward", 0.0, bw if bw is not None else self.analysis.step_time)] + ([("backward", bw, self.analysis.step_time)] if bw is not None else [])
        for name, start, end in spans:
            events.append({"ph": "X", "cat": "stage", "name": name, "pid": pid, "tid": tid["stage"], "ts": start * us, "dur": (end - start) * us})
        for g in self.compute_groups():
            ops = Counter(e.name.rstrip("0123456789").rstrip("_") for e in g.events)
            events.append({
                "ph": "X", "cat": "compute", "name": f"{g.stage} {g.label}".strip(), "pid": pid, "tid": tid["compute"],
                "ts": g.start * us, "dur": (g.end - g.start) * us,
                "args": {"nodes": len(g.events), "first": g.events[0].name, "last": g.events[-1].name, "ops": dict(ops.most_common(8))},
            })
        for e in self.collectives():
            events.append({
                "ph": "X", "cat": "collective", "name": e.kind, "pid": pid, "tid": tid[e.lane], "ts": e.start * us, "dur": (e.end - e.start) * us,
                "args": {"node": e.name, "stage": e.stage, "kind": e.kind, "bytes": e.nbytes, "params": list(e.params)},
            })
        for t, live in _downsample(self.analysis.memory_curve, 4000):
            events.append({"ph": "C", "name": "memory", "pid": pid, "ts": t * us, "args": {"live MiB": live / 2**20}})
        return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"title": self.title, "profile": self.profile.name}}

    def save_chrome_trace(self, path: str | Path) -> None:
        """Write :meth:`chrome_trace` as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.chrome_trace()))

    def html(self) -> str:
        """One self-contained page (inline SVG and CSS, no script, nothing fetched): summary,
        timeline, memory curve, buckets, passes and stage code."""
        return _render_html(self)

    def save_html(self, path: str | Path) -> None:
        """Write :meth:`html` to ``path``."""
        Path(path).write_text(self.html())

    def save(self, folder: str | Path) -> None:
        """Write ``report.html``, ``trace.json`` and ``summary.txt`` into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.save_html(folder / "report.html")
        self.save_chrome_trace(folder / "trace.json")
        (folder / "summary.txt").write_text(self.summary() + "\n\n" + "\n".join(p.text() for p in self.passes) + "\n")


def _downsample(curve: list[tuple[float, int]], bins: int) -> list[tuple[float, int]]:
    """At most ~4 points per time bin (first, min, max, last, in order), so the peak and the
    shape survive while a curve of 100k points shrinks to a few thousand."""
    if len(curve) <= 4 * bins:
        return list(curve)
    end = curve[-1][0] or 1.0
    out: list[tuple[float, int]] = []
    i = 0
    while i < len(curve):
        b = int(curve[i][0] / end * bins)
        j = i
        while j < len(curve) and int(curve[j][0] / end * bins) == b:
            j += 1
        chunk = curve[i:j]
        picks = {0, len(chunk) - 1, min(range(len(chunk)), key=lambda k: chunk[k][1]), max(range(len(chunk)), key=lambda k: chunk[k][1])}
        out.extend(chunk[k] for k in sorted(picks))
        i = j
    return out


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _ticks(end: float, target: int = 8) -> list[float]:
    """Round tick positions (1, 2 or 5 x 10^k apart) from 0 to ``end``."""
    if end <= 0:
        return [0.0]
    raw = end / target
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    return [i * step for i in range(int(end / step) + 1)]


_CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:600px;font-size:12px}
svg text{font:11px system-ui,sans-serif}.lane{fill:#f3f3f3}.compute{stroke:#fff;stroke-width:.5}.compute.forward{fill:#4e79a7}.compute.backward{fill:#76b7b2}
.collective rect{stroke:#222;stroke-width:.5}.all_gather rect{fill:#f28e2b}.reduce_scatter rect{fill:#b07aa1}.all_reduce rect{fill:#e15759}
.collective:hover rect{stroke-width:2}.memory{fill:none;stroke:#59a14f;stroke-width:1.5}.peak{fill:#e15759}
.bound{stroke:#999;stroke-dasharray:4 3}.stage{stroke:#222;stroke-dasharray:6 3}.axis{stroke:#999}
td.params{font-size:12px;max-width:900px}:target{background:#ffe9a8}
"""


def _render_html(r: Report) -> str:
    a = r.analysis
    end = max([a.step_time, *(e.end for e in a.timeline)]) or 1.0
    left, width, lane_h, gap, top = 150, 1100, 26, 6, 22
    x = lambda t: left + width * t / end  # noqa: E731
    lanes = ["compute", *sorted({e.lane for e in r.collectives()})]
    y = {lane: top + i * (lane_h + gap) for i, lane in enumerate(lanes)}
    mem_top = top + len(lanes) * (lane_h + gap) + 20
    mem_h = 150
    svg: list[str] = []
    for lane in lanes:
        label = lane if lane == "compute" else f"comm, group {lane.split(':', 1)[1]}"
        svg.append(f'<rect class="lane" x="{left}" y="{y[lane]}" width="{width}" height="{lane_h}"/>')
        svg.append(f'<text x="{left - 6}" y="{y[lane] + lane_h / 2 + 4}" text-anchor="end">{_esc(label)}</text>')
    for t in _ticks(end):
        svg.append(f'<line class="axis" x1="{x(t):.2f}" x2="{x(t):.2f}" y1="{top - 4}" y2="{mem_top + mem_h}"/>')
        svg.append(f'<text x="{x(t):.2f}" y="{top - 8}" text-anchor="middle">{_fmt_time(t) if t else "0"}</text>')
    for g in r.compute_groups():
        tip = f"{g.stage} compute {g.label}: {len(g.events)} nodes, {_fmt_time(g.end - g.start)} ({g.events[0].name} .. {g.events[-1].name})"
        svg.append(
            f'<rect class="compute {g.stage}" x="{x(g.start):.2f}" y="{y["compute"]}" width="{max(x(g.end) - x(g.start), 0.5):.2f}" '
            f'height="{lane_h}"><title>{_esc(tip)}</title></rect>'
        )
    for e in r.collectives():
        tip = (f"{e.stage} {e.kind} ({e.name}): {_fmt_bytes(e.nbytes)}, {_fmt_time(e.end - e.start)}, "
               f"{len(e.params)} parameters: {', '.join(e.params) or 'unknown'}")
        svg.append(
            f'<a href="#c-{e.stage}-{_esc(e.name)}"><g class="collective {e.kind}"><rect x="{x(e.start):.2f}" y="{y[e.lane] + 3}" '
            f'width="{max(x(e.end) - x(e.start), 1):.2f}" height="{lane_h - 6}"/><title>{_esc(tip)}</title></g></a>'
        )
    bw = r.backward_start()
    if bw is not None:
        svg.append(f'<line class="stage" x1="{x(bw):.2f}" x2="{x(bw):.2f}" y1="{top}" y2="{mem_top + mem_h}"/>')
        svg.append(f'<text x="{x(bw) + 4:.2f}" y="{mem_top - 6}">backward starts</text>')
    # Memory: a step curve of live bytes; the peak marked; the lower bound dashed.
    peak = max(a.peak_bytes, 1)
    my = lambda b: mem_top + mem_h - mem_h * b / (1.05 * peak)  # noqa: E731
    points, last = [], None
    for t, live in _downsample(a.memory_curve, width):
        if last is not None:
            points.append(f"{x(t):.2f},{my(last):.2f}")
        points.append(f"{x(t):.2f},{my(live):.2f}")
        last = live
    if last is not None:
        points.append(f"{x(end):.2f},{my(last):.2f}")
    t_peak = next((t for t, live in a.memory_curve if live == a.peak_bytes), 0.0)
    svg += [
        f'<rect class="lane" x="{left}" y="{mem_top}" width="{width}" height="{mem_h}"/>',
        f'<text x="{left - 6}" y="{mem_top + mem_h / 2}" text-anchor="end">memory (live bytes)</text>',
        f'<line class="bound" x1="{left}" x2="{left + width}" y1="{my(a.memory_lower_bound):.2f}" y2="{my(a.memory_lower_bound):.2f}">'
        f"<title>memory lower bound {_fmt_bytes(a.memory_lower_bound)}</title></line>",
        f'<polyline class="memory" points="{" ".join(points)}"/>',
        f'<circle class="peak" cx="{x(t_peak):.2f}" cy="{my(a.peak_bytes):.2f}" r="4"><title>peak {_fmt_bytes(a.peak_bytes)} at {_fmt_time(t_peak)}</title></circle>',
        f'<text x="{x(t_peak) + 7:.2f}" y="{my(a.peak_bytes) + 4:.2f}">peak {_fmt_bytes(a.peak_bytes)}</text>',
    ]
    height = mem_top + mem_h + 10

    rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in r.summary_rows())
    buckets = "".join(
        f'<tr id="c-{e.stage}-{_esc(e.name)}"><td>{e.stage}</td><td>{e.kind}</td><td>{_esc(e.name)}</td><td>{_fmt_bytes(e.nbytes)}</td>'
        f'<td>{_fmt_time(e.start)}</td><td>{_fmt_time(e.end - e.start)}</td><td>{len(e.params)}</td><td class="params">{_esc(", ".join(e.params))}</td></tr>'
        for e in r.collectives()
    )
    passes = "".join(f"<li>{_esc(p.text())}</li>" for p in r.passes)
    stages = []
    for stage, gm in r.stages.items():
        code = r.code(stage)
        if len(code) > _MAX_CODE_CHARS:
            code = code[:_MAX_CODE_CHARS] + f"\n# ... truncated ({len(code):,} characters); Report.code({stage!r}) or debug_dir has it all\n"
        stages.append(f"<details><summary>{stage} ({len(gm.graph.nodes)} nodes)</summary><pre>{_esc(code)}</pre></details>")
    title = f"autoshard report{': ' + r.title if r.title else ''}"
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{_esc(title)}</title><style>{_CSS}</style></head><body>
<h1>{_esc(title)}</h1>
<p>Rank {r.rank}, profile <b>{_esc(r.profile.name)}</b>. One simulated training step: compute runs on one stream, each
process group's collectives on their own; durations from the cost model.</p>
<h2>Summary</h2><table>{rows}</table>
<h2>Timeline</h2>
<p>Time runs left to right. The compute lane holds groups of nodes that ran back to back (dark: forward, light: backward);
a gap in it is compute waiting for a collective (exposed communication). Each communication lane is one process group;
every box is one collective (orange all-gather, purple reduce-scatter, red all-reduce): hover for its bytes and parameters,
click for its row in the bucket table. Below, the live memory of this rank, with its peak marked and the lower bound dashed.</p>
<svg width="{left + width + 20}" height="{height}" viewBox="0 0 {left + width + 20} {height}" role="img">{"".join(svg)}</svg>
<h2>Buckets</h2><p>One row per collective: the bucket it moves.</p>
<table><tr><th>stage</th><th>kind</th><th>node</th><th>bytes</th><th>start</th><th>duration</th><th>params</th><th>parameters</th></tr>{buckets}</table>
<h2>Passes</h2><ol>{passes}</ol>
<h2>Stages</h2>{"".join(stages)}
</body></html>
"""
