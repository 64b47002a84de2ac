"""Write a compiled graph's stages as Python code, for people to read."""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch.distributed as dist
from torch import fx

_graph_ids = itertools.count()


class GraphDump:
    """Writes ``<debug_dir>/rank<r>/graph<i>/<stage>.py``; does nothing without a debug_dir."""

    def __init__(self, debug_dir: str | None) -> None:
        self.folder = None
        if debug_dir:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.folder = Path(debug_dir) / f"rank{rank}" / f"graph{next(_graph_ids)}"
            os.makedirs(self.folder, exist_ok=True)

    def write(self, stage: str, gm: fx.GraphModule) -> None:
        if self.folder is not None:
            code = gm.print_readable(print_output=False, include_stride=True, include_device=True)
            (self.folder / f"{stage}.py").write_text(code)
