import inspect
import os
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The tests share the example's GPT; spawned workers inherit this sys.path.
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))
# Caches could hide a changed pass between runs.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")


@pytest.fixture
def drawing(request) -> Callable[[str], list[str]]:
    """``drawing("before")``: the events the test's docstring draws on its line ``before: ...``
    and the indented lines under it. The assertions compare against the drawing itself."""
    lines = inspect.getdoc(request.function).splitlines()

    def get(name: str) -> list[str]:
        for i, line in enumerate(lines):
            if line.startswith(f"{name}:"):
                found = line.split(":", 1)[1].split()
                for more in lines[i + 1:]:
                    if not more.startswith(" ") or not more.strip():
                        break
                    found += more.split()
                return found
        raise KeyError(f"{request.function.__name__} draws no {name!r}")

    return get
