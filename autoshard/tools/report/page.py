"""The report's HTML page: one self-contained file (inline SVG and CSS, no script, nothing
fetched) drawn from a :class:`autoshard.tools.report.report.Report`, through :class:`ReportView`:
what the page reads of it (report.py imports this module to render, so this one does not import
report.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import fx

from autoshard.cost.cost_model import DeviceProfile
from autoshard.cost.liveness import parameters_label
from autoshard.cost.simulator import Event, StepAnalysis
from autoshard.tools.report.code import page_code
from autoshard.tools.report.memory_panel import MEMORY_CSS, memory_panel, peak_tables
from autoshard.tools.report.pass_changes import PassSummary
from autoshard.tools.report.svg import Layout, esc, ticks
from autoshard.tools.units import fmt_bytes, fmt_time


@dataclass(frozen=True)
class ComputeGroup:
    """Consecutive compute nodes of one stage that ran back to back: no collective issued and
    no wait stalled compute between them. ``label``: the model block most of them come from."""

    stage: str
    start: float
    end: float
    events: tuple[Event, ...]
    label: str


class ReportView(Protocol):
    """The part of a report the HTML page draws from (its memory panel: ``analysis`` alone)."""

    stages: dict[str, fx.GraphModule]
    profile: DeviceProfile
    title: str
    rank: int
    analysis: StepAnalysis
    passes: list[PassSummary]

    def collectives(self) -> list[Event]: ...

    def compute_groups(self) -> list[ComputeGroup]: ...

    def backward_start(self) -> float | None: ...

    def summary_rows(self) -> list[tuple[str, str]]: ...


PAGE_STAGES = ("forward", "backward")  # whose code the page carries: what runs; the rest are named

_CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:600px;font-size:12px}
svg text{font:11px system-ui,sans-serif}.lane{fill:#f3f3f3}.compute{stroke:#fff;stroke-width:.5}
.compute.forward{fill:#4e79a7}.compute.backward{fill:#76b7b2}text.forward{fill:#fff}text.backward{fill:#123}
.collective rect{stroke:#222;stroke-width:.5}.all_gather rect{fill:#f28e2b}.reduce_scatter rect{fill:#b07aa1}.all_reduce rect{fill:#e15759}
.collective:hover rect{stroke-width:2}.memory{fill:none;stroke:#222;stroke-width:1}.peak{fill:#e15759;stroke:#fff}
.exposed{fill:#e15759;opacity:.45}.exposed:hover{opacity:.8}
.bound{stroke:#555;stroke-dasharray:4 3}.stage{stroke:#222;stroke-dasharray:6 3}.axis{stroke:#ccc;stroke-width:.5}
td.params{font-size:12px;max-width:700px}td.num{text-align:right}:target{background:#ffe9a8}
"""


def _lanes(r: ReportView, at: Layout) -> list[str]:
    """Lane backgrounds and labels, and the time axis."""
    svg = []
    for lane in at.lanes:
        label = lane if lane == "compute" else f"comm, group {lane.split(':', 1)[1]}"
        svg.append(f'<rect class="lane" x="{at.left}" y="{at.y(lane)}" width="{at.width}" height="{at.lane_h}"/>')
        svg.append(f'<text x="{at.left - 6}" y="{at.y(lane) + at.lane_h / 2 + 4}" text-anchor="end">{esc(label)}</text>')
    for t in ticks(at.end):
        svg.append(f'<line class="axis" x1="{at.x(t):.1f}" x2="{at.x(t):.1f}" y1="{at.top - 4}" y2="{at.mem_top + at.mem_h}"/>')
        svg.append(f'<text x="{at.x(t):.1f}" y="{at.top - 8}" text-anchor="middle">{fmt_time(t) if t else "0"}</text>')
    return svg


def _boxes(r: ReportView, at: Layout) -> list[str]:
    """One box per compute group (named by its module where it fits), one per collective
    (linked to its bucket row), the exposed intervals shaded, and where the backward starts."""
    svg = []
    y = at.y("compute")
    for g in r.compute_groups():
        tip = f"{g.stage} compute {g.label}: {len(g.events)} nodes, {fmt_time(g.end - g.start)} ({g.events[0].name} .. {g.events[-1].name})"
        x, w = at.x(g.start), max(at.x(g.end) - at.x(g.start), 0.5)
        svg.append(f'<rect class="compute {g.stage}" x="{x:.1f}" y="{y}" width="{w:.1f}" height="{at.lane_h}">'
                   f"<title>{esc(tip)}</title></rect>")
        fits = int((w - 4) / 6)
        if g.label and fits >= 3:  # short module names inside boxes wide enough
            label = g.label if len(g.label) <= fits else g.label[: fits - 1] + "…"
            svg.append(f'<text class="{g.stage}" x="{x + 2:.1f}" y="{y + at.lane_h / 2 + 4}">{esc(label)}</text>')
    events = {(e.stage, e.name): e for e in r.collectives()}
    for s in r.analysis.stalls:
        e = events[(s.stage, s.name)]
        bucket = parameters_label(e.params) if e.params else "parameters unknown"
        tip = f"exposed {fmt_time(s.end - s.start)}: compute waits for {e.stage} {e.kind} {e.name} ({bucket})"
        svg.append(f'<a href="#c-{e.stage}-{esc(e.name)}"><rect class="exposed" x="{at.x(s.start):.1f}" y="{y}" '
                   f'width="{max(at.x(s.end) - at.x(s.start), 0.5):.1f}" height="{at.lane_h}"><title>{esc(tip)}</title></rect></a>')
    for e in r.collectives():
        tip = (f"{e.stage} {e.kind} ({e.name}): {fmt_bytes(e.nbytes)}, {fmt_time(e.end - e.start)}, exposed {fmt_time(e.exposed)}, "
               f"{len(e.params)} parameters: {', '.join(e.params) or 'unknown'}")
        svg.append(
            f'<a href="#c-{e.stage}-{esc(e.name)}"><g class="collective {e.kind}"><rect x="{at.x(e.start):.1f}" y="{at.y(e.lane) + 3}" '
            f'width="{max(at.x(e.end) - at.x(e.start), 1):.1f}" height="{at.lane_h - 6}"/><title>{esc(tip)}</title></g></a>'
        )
    bw = r.backward_start()
    if bw is not None:
        svg.append(f'<line class="stage" x1="{at.x(bw):.1f}" x2="{at.x(bw):.1f}" y1="{at.top}" y2="{at.mem_top + at.mem_h}"/>')
        svg.append(f'<text x="{at.x(bw) - 4:.1f}" y="{at.mem_top - 6}" text-anchor="end">backward starts</text>')
    return svg


def _timeline(r: ReportView) -> str:
    a = r.analysis
    at = Layout(max([a.step_time, *(e.end for e in a.timeline)]) or 1.0, ("compute", *sorted({e.lane for e in r.collectives()})))
    svg = _lanes(r, at) + memory_panel(r.analysis, at) + _boxes(r, at)
    w = at.left + at.width + 20
    return f'<svg width="{w}" height="{at.height}" viewBox="0 0 {w} {at.height}" role="img">{"".join(svg)}</svg>'


def _bucket_rows(r: ReportView) -> str:
    """One row per collective, the most exposed first (then in program order)."""
    step = r.analysis.step_time or 1.0
    ranked = sorted(enumerate(r.collectives()), key=lambda ie: (-ie[1].exposed, ie[0]))
    return "".join(
        f'<tr id="c-{e.stage}-{esc(e.name)}"><td>{e.stage}</td><td>{e.kind}</td><td>{esc(e.name)}</td>'
        f"<td>{esc(parameters_label(e.params)) if e.params else ''}</td><td class=num>{fmt_bytes(e.nbytes)}</td>"
        f"<td class=num>{fmt_time(e.start)}</td><td class=num>{fmt_time(e.end - e.start)}</td>"
        f"<td class=num>{fmt_time(e.exposed) if e.exposed else '0'}</td><td class=num>{100 * e.exposed / step:.1f}%</td>"
        f'<td class=num>{len(e.params)}</td><td class="params">{esc(", ".join(e.params))}</td></tr>'
        for _, e in ranked
    )


def _stages(r: ReportView, files: frozenset[str]) -> str:
    """The code of :data:`PAGE_STAGES`, collapsed; the other stages by name (linked to their
    file when the page sits next to a debug_dir dump)."""
    parts, others = [], []
    for stage, gm in r.stages.items():
        nodes = f"{len(gm.graph.nodes)} nodes"
        if stage in PAGE_STAGES:
            parts.append(f"<details><summary>{stage} ({nodes})</summary><pre>{esc(page_code(gm, stage))}</pre></details>")
        elif stage in files:
            others.append(f'<a href="{stage}.py">{stage}</a> ({nodes})')
        else:
            others.append(f"{stage} ({nodes})")
    if others:
        parts.append(f"<p>Earlier stages: {', '.join(others)}; each in full with <code>Report.code(stage)</code> "
                     "or as a file under <code>--dump-dir</code> / <code>debug_dir</code>.</p>")
    return "".join(parts)


def render_html(r: ReportView, stage_files: frozenset[str] = frozenset()) -> str:
    """The page of :meth:`autoshard.tools.report.report.Report.html`: summary, timeline with the
    memory panel, what is alive at the peak, buckets by exposed time, passes and the final
    stages' code. ``stage_files``: stages written as ``<stage>.py`` next to the page."""
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in r.summary_rows())
    passes = "".join(f"<li>{esc(p.text())}</li>" for p in r.passes)
    title = f"autoshard report{': ' + r.title if r.title else ''}"
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{esc(title)}</title><style>{_CSS}{MEMORY_CSS}</style></head><body>
<h1>{esc(title)}</h1>
<p>Rank {r.rank}, profile <b>{esc(r.profile.name)}</b>. One simulated training step: compute runs on one stream, each
process group's collectives on their own; durations from the cost model.</p>
<h2>Summary</h2><table>{rows}</table>
<h2>Timeline</h2>
<p>Time runs left to right. The compute lane holds groups of nodes that ran back to back (dark: forward, light: backward),
named by the module most of them come from. Red shading in it is exposed communication: compute waiting for a collective
(hover to see which; click for its bucket row). Each communication lane is one process group; every box is one collective
(orange all-gather, purple reduce-scatter, red all-reduce): hover for its bytes and parameters, click for its row in the
bucket table. Below, the live memory of this rank, stacked by what it holds, with its peak marked and the lower bound dashed
(no order of the same compute needs less).</p>
{_timeline(r)}
<h2>Memory at the peak</h2>{peak_tables(r.analysis)}
<h2>Buckets</h2><p>One row per collective, the most exposed first: <i>exposed</i> is the step time it added (compute waiting
at its wait, the step running past the last compute to finish it, compute slowed while it ran).</p>
<table><tr><th>stage</th><th>kind</th><th>node</th><th>bucket</th><th>bytes</th><th>start</th><th>duration</th><th>exposed</th>
<th>of step</th><th>params</th><th>parameters</th></tr>{_bucket_rows(r)}</table>
<h2>Passes</h2><ol>{passes}</ol>
<h2>Stages</h2>{_stages(r, stage_files)}
</body></html>
"""
