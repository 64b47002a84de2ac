"""The report page's memory panel: live bytes of one rank over the simulated step as a stacked
area by what they hold (:data:`autoshard.cost.liveness.CATEGORIES`) on a labelled axis, the
peak and the lower bound marked; and the tables of what is alive at the peak."""
from __future__ import annotations

from autoshard.cost.liveness import CATEGORIES
from autoshard.cost.simulator import StepAnalysis
from autoshard.tools.report.svg import Layout, esc, peak_positions, ticks
from autoshard.tools.units import byte_unit, fmt_bytes, fmt_time

COLORS = {
    "shards": "#9c755f",
    "inputs": "#bab0ac",
    "gradients": "#b07aa1",
    "activations": "#4e79a7",
    "gathered": "#f28e2b",
    "comm_buffers": "#e15759",
    "temporaries": "#8cd17d",
}

MEMORY_CSS = "".join(f".m-{c}{{fill:{color}}}" for c, color in COLORS.items()) + (
    ".area{stroke:none;opacity:.85}.swatch{display:inline-block;width:10px;height:10px;margin-right:4px}"
)


def _steps(xs: list[float], ys: list[float]) -> str:
    """Points of a step line (each value held until the next x), flat runs reduced to their
    ends: a constant category costs two points, not a thousand."""
    points = [(xs[0], ys[0])]
    for i in range(1, len(xs)):
        points += [(xs[i], ys[i - 1]), (xs[i], ys[i])]
    keep = [p for i, p in enumerate(points)
            if i in (0, len(points) - 1) or not (points[i - 1][1] == p[1] == points[i + 1][1] or points[i - 1] == p)]
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in keep)


def memory_panel(a: StepAnalysis, at: Layout) -> list[str]:
    """SVG parts of ``a``'s memory: the stacked area (one polygon per category, drawn top-down so
    each covers the ones above it from its own top), the total as a line, a y axis in one byte
    unit, the peak dot, the lower bound dashed, and a legend with each category's bytes at the peak."""
    curve = a.memory_curve
    if not curve:
        return []
    top = 1.05 * max(a.peak_bytes, a.memory_lower_bound, 1)
    bottom = at.mem_top + at.mem_h
    my = lambda b: bottom - at.mem_h * b / top  # noqa: E731
    picks = peak_positions(curve, at.width // 2)
    xs = [at.x(curve[i][0]) for i in picks] + [at.x(at.end)]
    present = [c for c in CATEGORIES if any(a.memory_by_category.get(c, ()))]
    svg = [f'<rect class="lane" x="{at.left}" y="{at.mem_top}" width="{at.width}" height="{at.mem_h}"/>']
    unit, size = byte_unit(top / 1.05)
    for v in ticks(top / size, target=5):
        y = my(v * size)
        svg.append(f'<line class="axis" x1="{at.left - 4}" x2="{at.left + at.width}" y1="{y:.1f}" y2="{y:.1f}"/>')
        svg.append(f'<text x="{at.left - 7}" y="{y + 4:.1f}" text-anchor="end">{v:g} {unit}</text>')
    label_y = at.mem_top + at.mem_h / 2
    svg.append(f'<text transform="translate({at.left - 62},{label_y:.0f}) rotate(-90)" text-anchor="middle">'
               f"live memory per rank ({unit})</text>")
    stacked = [0] * len(picks)
    tops: dict[str, list[int]] = {}
    for c in present:
        series = a.memory_by_category[c]
        stacked = [s + series[i] for s, i in zip(stacked, picks)]
        tops[c] = stacked
    peak = a.memory_peak
    for c in reversed(present):
        path = _steps(xs, [my(v) for v in tops[c] + tops[c][-1:]])
        at_peak = peak.by_category.get(c, 0) if peak else 0
        svg.append(f'<polygon class="area m-{c}" points="{xs[0]:.1f},{bottom} {path} {xs[-1]:.1f},{bottom}">'
                   f"<title>{esc(CATEGORIES[c])}: {fmt_bytes(at_peak)} at the peak</title></polygon>")
    line = _steps(xs, [my(v) for v in stacked + stacked[-1:]])
    svg.append(f'<polyline class="memory" points="{line}"/>')
    bound_y = my(a.memory_lower_bound)
    svg.append(f'<line class="bound" x1="{at.left}" x2="{at.left + at.width}" y1="{bound_y:.1f}" y2="{bound_y:.1f}">'
               f"<title>memory lower bound {fmt_bytes(a.memory_lower_bound)}</title></line>")
    t_peak = peak.time if peak else 0.0
    px, py = at.x(t_peak), my(a.peak_bytes)
    where = f" ({peak.stage}, {peak.node})" if peak and peak.node else ""
    svg.append(f'<circle class="peak" cx="{px:.1f}" cy="{py:.1f}" r="4"><title>peak {fmt_bytes(a.peak_bytes)} at '
               f"{fmt_time(t_peak)}{esc(where)}</title></circle>")
    anchor = "end" if px > at.left + 0.8 * at.width else "start"
    svg.append(f'<text x="{px + (-7 if anchor == "end" else 7):.1f}" y="{py - 4:.1f}" text-anchor="{anchor}">'
               f"peak {fmt_bytes(a.peak_bytes)}</text>")
    x, y = at.left, bottom + 22
    svg.append(f'<text x="{x}" y="{y + 9}">at the peak:</text>')
    x += 80
    for c in present:  # the legend, in stacking order, wrapped to the panel's width
        text = f"{CATEGORIES[c]} {fmt_bytes(peak.by_category.get(c, 0)) if peak else ''}"
        width = 14 + 6.5 * len(text) + 14
        if x + width > at.left + at.width:
            x, y = at.left + 80, y + 16
        svg.append(f'<rect class="m-{c}" x="{x:.0f}" y="{y}" width="10" height="10"/><text x="{x + 14:.0f}" y="{y + 9}">{esc(text)}</text>')
        x += width
    return svg


def peak_tables(a: StepAnalysis) -> str:
    """HTML: the bytes alive at ``a``'s peak per category, and the largest tensors alive there."""
    peak = a.memory_peak
    if peak is None:
        return ""
    total = max(a.peak_bytes, 1)
    rows = "".join(
        f'<tr><td><span class="swatch m-{c}" style="background:{COLORS[c]}"></span>{esc(CATEGORIES[c])}</td>'
        f"<td>{fmt_bytes(b)}</td><td>{100 * b / total:.1f}%</td></tr>"
        for c, b in sorted(peak.by_category.items(), key=lambda kv: -kv[1]) if b
    )
    largest = "".join(
        f"<tr><td>{fmt_bytes(t.nbytes)}</td><td>{esc(CATEGORIES[t.category])}</td><td>{esc(t.owner)}</td>"
        f"<td>{esc(t.value)}</td><td>{t.stage} {esc(t.node)}</td></tr>"
        for t in peak.largest
    )
    return (
        f"<p>Peak {fmt_bytes(a.peak_bytes)} in the {peak.stage} at {fmt_time(peak.time)}, while <code>{esc(peak.node)}</code> "
        f"runs; lower bound {fmt_bytes(a.memory_lower_bound)}.</p>"
        f'<div style="display:flex;gap:24px;align-items:flex-start"><table><tr><th>alive at the peak</th><th>bytes</th>'
        f"<th>share</th></tr>{rows}</table>"
        f"<table><tr><th>largest alive at the peak</th><th>holds</th><th>owner (module or parameters)</th><th>value</th>"
        f"<th>made by</th></tr>{largest}</table></div>"
    )
