"""What the report's page and trace draw with: curve downsampling, axis ticks and the
timeline's layout in SVG pixels (number formats: :mod:`autoshard.tools.units`)."""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _bins(curve: list[tuple[float, int]], bins: int) -> list[list[int]]:
    """Positions of ``curve`` grouped by time bin (``bins`` of equal width over the curve)."""
    end = curve[-1][0] or 1.0
    groups: list[list[int]] = []
    last = None
    for i, (t, _) in enumerate(curve):
        b = int(t / end * bins)
        if b != last:
            groups.append([])
            last = b
        groups[-1].append(i)
    return groups


def downsample(curve: list[tuple[float, int]], bins: int) -> list[tuple[float, int]]:
    """At most ~4 points per time bin (first, min, max, last, in order), so the peak and the
    shape survive while a curve of 100k points shrinks to a few thousand."""
    if len(curve) <= 4 * bins:
        return list(curve)
    out: list[tuple[float, int]] = []
    for group in _bins(curve, bins):
        values = [curve[i][1] for i in group]
        picks = {0, len(group) - 1, values.index(min(values)), values.index(max(values))}
        out.extend(curve[group[k]] for k in sorted(picks))
    return out


def peak_positions(curve: list[tuple[float, int]], bins: int) -> list[int]:
    """One position per time bin, the highest in it (the first on ties): a stacked area drawn
    through them keeps the peak and splits it exactly as the full curve does."""
    if len(curve) <= bins:
        return list(range(len(curve)))
    return [max(group, key=lambda i: (curve[i][1], -i)) for group in _bins(curve, bins)]


def ticks(end: float, target: int = 8) -> list[float]:
    """Round tick positions (1, 2 or 5 x 10^k apart) from 0 to ``end``."""
    if end <= 0:
        return [0.0]
    raw = end / target
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    return [i * step for i in range(int(end / step + 1e-9) + 1)]


@dataclass(frozen=True)
class Layout:
    """Where the timeline's parts go, in SVG pixels; ``end``: the simulated seconds drawn."""

    end: float
    lanes: tuple[str, ...]
    left: int = 150
    width: int = 1100
    lane_h: int = 26
    gap: int = 6
    top: int = 22
    mem_h: int = 240

    def x(self, t: float) -> float:
        return self.left + self.width * t / self.end

    def y(self, lane: str) -> int:
        return self.top + self.lanes.index(lane) * (self.lane_h + self.gap)

    @property
    def mem_top(self) -> int:
        return self.top + len(self.lanes) * (self.lane_h + self.gap) + 24

    @property
    def height(self) -> int:
        return self.mem_top + self.mem_h + 60  # room for two rows of legend under the memory panel
