"""What a report's pages read of a :class:`autoshard.tools.report.report.Report`: the shared piece
report.py, page.py and memory_panel.py import, so that none of the page modules
imports report.py (which imports them): no import circle."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import fx

from autoshard.compiler.cost_model import DeviceProfile
from autoshard.tools.report.pass_changes import PassSummary
from autoshard.tools.sim.simulator import Event, StepAnalysis


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
    """The part of a report the HTML page and its memory panel draw from."""

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
