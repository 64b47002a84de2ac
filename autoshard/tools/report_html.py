"""The report's HTML page: one self-contained file (inline SVG and CSS, no script, nothing
fetched) drawn from a :class:`autoshard.tools.report.Report`, and the number formats the report's
text shares with it."""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autoshard.tools.report import Report

_MAX_CODE_CHARS = 500_000  # per stage in the HTML page; an 8B model's joint graph is tens of MB


def fmt_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, three significant digits."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: float) -> str:
    """``s`` seconds in s, ms, us or ns, four significant digits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.4g} {unit}"
    return f"{s * 1e9:.4g} ns"


def downsample(curve: list[tuple[float, int]], bins: int) -> list[tuple[float, int]]:
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
svg text{font:11px system-ui,sans-serif}.lane{fill:#f3f3f3}.compute{stroke:#fff;stroke-width:.5}
.compute.forward{fill:#4e79a7}.compute.backward{fill:#76b7b2}
.collective rect{stroke:#222;stroke-width:.5}.all_gather rect{fill:#f28e2b}.reduce_scatter rect{fill:#b07aa1}.all_reduce rect{fill:#e15759}
.collective:hover rect{stroke-width:2}.memory{fill:none;stroke:#59a14f;stroke-width:1.5}.peak{fill:#e15759}
.bound{stroke:#999;stroke-dasharray:4 3}.stage{stroke:#222;stroke-dasharray:6 3}.axis{stroke:#999}
td.params{font-size:12px;max-width:900px}:target{background:#ffe9a8}
"""


@dataclass(frozen=True)
class _Layout:
    """Where the timeline's parts go, in SVG pixels; ``end``: the simulated seconds drawn."""

    end: float
    lanes: tuple[str, ...]
    left: int = 150
    width: int = 1100
    lane_h: int = 26
    gap: int = 6
    top: int = 22
    mem_h: int = 150

    def x(self, t: float) -> float:
        return self.left + self.width * t / self.end

    def y(self, lane: str) -> int:
        return self.top + self.lanes.index(lane) * (self.lane_h + self.gap)

    @property
    def mem_top(self) -> int:
        return self.top + len(self.lanes) * (self.lane_h + self.gap) + 20

    @property
    def height(self) -> int:
        return self.mem_top + self.mem_h + 10


def _lanes(r: Report, at: _Layout) -> list[str]:
    """Lane backgrounds and labels, and the time axis."""
    svg = []
    for lane in at.lanes:
        label = lane if lane == "compute" else f"comm, group {lane.split(':', 1)[1]}"
        svg.append(f'<rect class="lane" x="{at.left}" y="{at.y(lane)}" width="{at.width}" height="{at.lane_h}"/>')
        svg.append(f'<text x="{at.left - 6}" y="{at.y(lane) + at.lane_h / 2 + 4}" text-anchor="end">{_esc(label)}</text>')
    for t in _ticks(at.end):
        svg.append(f'<line class="axis" x1="{at.x(t):.2f}" x2="{at.x(t):.2f}" y1="{at.top - 4}" y2="{at.mem_top + at.mem_h}"/>')
        svg.append(f'<text x="{at.x(t):.2f}" y="{at.top - 8}" text-anchor="middle">{fmt_time(t) if t else "0"}</text>')
    return svg


def _boxes(r: Report, at: _Layout) -> list[str]:
    """One box per compute group and per collective (linked to its bucket row), and where
    the backward starts."""
    svg = []
    for g in r.compute_groups():
        tip = f"{g.stage} compute {g.label}: {len(g.events)} nodes, {fmt_time(g.end - g.start)} ({g.events[0].name} .. {g.events[-1].name})"
        svg.append(
            f'<rect class="compute {g.stage}" x="{at.x(g.start):.2f}" y="{at.y("compute")}" '
            f'width="{max(at.x(g.end) - at.x(g.start), 0.5):.2f}" height="{at.lane_h}"><title>{_esc(tip)}</title></rect>'
        )
    for e in r.collectives():
        tip = (f"{e.stage} {e.kind} ({e.name}): {fmt_bytes(e.nbytes)}, {fmt_time(e.end - e.start)}, "
               f"{len(e.params)} parameters: {', '.join(e.params) or 'unknown'}")
        svg.append(
            f'<a href="#c-{e.stage}-{_esc(e.name)}"><g class="collective {e.kind}"><rect x="{at.x(e.start):.2f}" y="{at.y(e.lane) + 3}" '
            f'width="{max(at.x(e.end) - at.x(e.start), 1):.2f}" height="{at.lane_h - 6}"/><title>{_esc(tip)}</title></g></a>'
        )
    bw = r.backward_start()
    if bw is not None:
        svg.append(f'<line class="stage" x1="{at.x(bw):.2f}" x2="{at.x(bw):.2f}" y1="{at.top}" y2="{at.mem_top + at.mem_h}"/>')
        svg.append(f'<text x="{at.x(bw) + 4:.2f}" y="{at.mem_top - 6}">backward starts</text>')
    return svg


def _memory(r: Report, at: _Layout) -> list[str]:
    """A step curve of live bytes; the peak marked; the lower bound dashed."""
    a = r.analysis
    peak = max(a.peak_bytes, 1)
    my = lambda b: at.mem_top + at.mem_h - at.mem_h * b / (1.05 * peak)  # noqa: E731
    points, last = [], None
    for t, live in downsample(a.memory_curve, at.width):
        if last is not None:
            points.append(f"{at.x(t):.2f},{my(last):.2f}")
        points.append(f"{at.x(t):.2f},{my(live):.2f}")
        last = live
    if last is not None:
        points.append(f"{at.x(at.end):.2f},{my(last):.2f}")
    t_peak = next((t for t, live in a.memory_curve if live == a.peak_bytes), 0.0)
    peak_x, peak_y, bound_y = at.x(t_peak), my(a.peak_bytes), my(a.memory_lower_bound)
    return [
        f'<rect class="lane" x="{at.left}" y="{at.mem_top}" width="{at.width}" height="{at.mem_h}"/>',
        f'<text x="{at.left - 6}" y="{at.mem_top + at.mem_h / 2}" text-anchor="end">memory (live bytes)</text>',
        f'<line class="bound" x1="{at.left}" x2="{at.left + at.width}" y1="{bound_y:.2f}" y2="{bound_y:.2f}">'
        f"<title>memory lower bound {fmt_bytes(a.memory_lower_bound)}</title></line>",
        f'<polyline class="memory" points="{" ".join(points)}"/>',
        f'<circle class="peak" cx="{peak_x:.2f}" cy="{peak_y:.2f}" r="4"><title>peak {fmt_bytes(a.peak_bytes)} at '
            f'{fmt_time(t_peak)}</title></circle>',
        f'<text x="{peak_x + 7:.2f}" y="{peak_y + 4:.2f}">peak {fmt_bytes(a.peak_bytes)}</text>',
    ]


def _timeline(r: Report) -> str:
    a = r.analysis
    at = _Layout(max([a.step_time, *(e.end for e in a.timeline)]) or 1.0, ("compute", *sorted({e.lane for e in r.collectives()})))
    svg = _lanes(r, at) + _boxes(r, at) + _memory(r, at)
    w = at.left + at.width + 20
    return f'<svg width="{w}" height="{at.height}" viewBox="0 0 {w} {at.height}" role="img">{"".join(svg)}</svg>'


def _bucket_rows(r: Report) -> str:
    return "".join(
        f'<tr id="c-{e.stage}-{_esc(e.name)}"><td>{e.stage}</td><td>{e.kind}</td><td>{_esc(e.name)}</td><td>{fmt_bytes(e.nbytes)}</td>'
        f'<td>{fmt_time(e.start)}</td><td>{fmt_time(e.end - e.start)}</td><td>{len(e.params)}</td>'
        f'<td class="params">{_esc(", ".join(e.params))}</td></tr>'
        for e in r.collectives()
    )


def _stages(r: Report) -> str:
    stages = []
    for stage, gm in r.stages.items():
        code = r.code(stage)
        if len(code) > _MAX_CODE_CHARS:
            code = code[:_MAX_CODE_CHARS] + (
                f"\n# ... truncated ({len(code):,} characters); Report.code({stage!r}) or debug_dir has it all\n")
        stages.append(f"<details><summary>{stage} ({len(gm.graph.nodes)} nodes)</summary><pre>{_esc(code)}</pre></details>")
    return "".join(stages)


def render_html(r: Report) -> str:
    """The page of :meth:`autoshard.tools.report.Report.html`: summary, timeline, memory curve,
    buckets, passes and stage code."""
    rows = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in r.summary_rows())
    passes = "".join(f"<li>{_esc(p.text())}</li>" for p in r.passes)
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
{_timeline(r)}
<h2>Buckets</h2><p>One row per collective: the bucket it moves.</p>
<table><tr><th>stage</th><th>kind</th><th>node</th><th>bytes</th><th>start</th><th>duration</th><th>params</th><th>parameters</th></tr>{_bucket_rows(r)}</table>
<h2>Passes</h2><ol>{passes}</ol>
<h2>Stages</h2>{_stages(r)}
</body></html>
"""
