import inspect
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The tests share the example's GPT; spawned workers inherit this sys.path.
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))
# The benchmarks' helpers some tests check; last, so bench/checkpoint.py shadows nothing.
sys.path.append(str(ROOT / "bench"))
# Caches could hide a changed pass between runs.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
# Ranks and subprocesses share 2 cores: Inductor's pool of compile workers only adds processes
# to start (tests/models: 107 s with the pool, 83 s without).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from tiers import select_tiers  # noqa: E402 - tests/ is on sys.path from here


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    select_tiers(config, items)  # tests/tiers.py


@pytest.fixture
def world8() -> Iterator[None]:
    """A fake process group of 8 ranks: the collectives' meta kernels in hand-built graphs
    resolve their group name."""
    from fake_pg import fake_world

    with fake_world(8):
        yield


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
