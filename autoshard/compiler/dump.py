"""Keep a compiled graph's stages: as Python code in a folder, for people to read, and in
memory while :func:`recording`, for tools and tests."""
from __future__ import annotations

import contextlib
import copy
import itertools
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, Iterator

import torch.distributed as dist
from torch import fx

if TYPE_CHECKING:
    from autoshard.cost.cost_model import DeviceProfile

_graph_ids = itertools.count()
_recordings: list[tuple[list[dict[str, fx.GraphModule]], Collection[str] | None]] = []


@contextlib.contextmanager
def recording(stages: Collection[str] | None = None) -> Iterator[list[dict[str, fx.GraphModule]]]:
    """Collect, for each graph the backend compiles meanwhile, a copy of every stage it writes
    (``captured``, ``joint``, ``lowered``, ``forward_bucketed``, ``forward``, ...), or of
    ``stages`` only (a copy of a large graph takes seconds)."""
    graphs: list[dict[str, fx.GraphModule]] = []
    entry = (graphs, stages)
    _recordings.append(entry)
    try:
        yield graphs
    finally:
        _recordings.remove(entry)


class GraphDump:
    """Writes ``<debug_dir>/rank<r>/graph<i>/<stage>.py`` (nothing without a debug_dir) and
    records copies of the stages while :func:`recording` is active (or always, with ``keep``)."""

    def __init__(self, debug_dir: str | None, keep: bool = False) -> None:
        self.stages: dict[str, fx.GraphModule] = {}
        self.keep = keep  # copy every stage (a structured trace's timeline reads them)
        for graphs, _ in _recordings:
            graphs.append(self.stages)
        self.folder = None
        if debug_dir:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.folder = Path(debug_dir) / f"rank{rank}" / f"graph{next(_graph_ids)}"
            os.makedirs(self.folder, exist_ok=True)

    def write(self, stage: str, gm: fx.GraphModule) -> None:
        # A copy (later passes and Inductor change graphs in place), for recordings and for
        # the debug_dir report.
        if self.keep or self.folder is not None or any(wanted is None or stage in wanted for _, wanted in _recordings):
            with warnings.catch_warnings():  # copying a graph's pytree specs warns of a deprecation inside torch
                warnings.simplefilter("ignore", FutureWarning)
                self.stages[stage] = fx.GraphModule(gm, copy.deepcopy(gm.graph))
                self.stages[stage].meta.update(gm.meta)  # what the passes decided (e.g. the schedule's plan)
        if self.folder is not None:
            code = gm.print_readable(print_output=False, include_stride=True, include_device=True)
            (self.folder / f"{stage}.py").write_text(code)

    def write_report(self, profile: str | DeviceProfile) -> None:
        """With a debug_dir: hand the stages written so far to every :data:`REPORT_WRITERS`
        entry (``autoshard/__init__.py`` registers :func:`autoshard.tools.report.report.write_report`:
        ``report.html``, ``trace.json`` and ``summary.txt``). A report that fails only warns: it must not stop the compile it
        describes."""
        if self.folder is None:
            return
        for write in REPORT_WRITERS:
            try:
                write(self.stages, profile, self.folder)
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"autoshard: could not write the report in {self.folder}: {type(e).__name__}: {e}", stacklevel=2)


ReportWriter = Callable[[dict[str, fx.GraphModule], "str | DeviceProfile", Path], None]
# What turns a graph's stages into reports next to them: filled by register_report_writer, which
# autoshard/__init__.py calls with the tools' writer, so the compiler never imports the tools
# that read its output.
REPORT_WRITERS: list[ReportWriter] = []


def register_report_writer(writer: ReportWriter) -> None:
    """Have ``writer(stages, profile, folder)`` write a report in every debug_dir compile's
    folder (once, however often it is registered)."""
    if writer not in REPORT_WRITERS:
        REPORT_WRITERS.append(writer)
