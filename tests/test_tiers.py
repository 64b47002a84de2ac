"""The test tiers (tests/tiers.py, markers in pyproject.toml): a bare run leaves out the tiers
with a command of their own, a path or ``-m`` chooses instead; and ``.ci/run`` runs exactly the
test commands README's quick start gives."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiers import OWN_COMMAND, select_tiers

ROOT = Path(__file__).resolve().parents[1]


class _Item:
    def __init__(self, path: str, *markers: str) -> None:
        self.path, self.markers = ROOT / "tests" / path, set(markers)

    def add_marker(self, name: str) -> None:
        self.markers.add(name)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None


def _select(args_source: pytest.Config.ArgsSource, markexpr: str = "") -> tuple[list[str], list[str]]:
    items = [_Item("test_a.py"), _Item("test_a.py", "slow"), _Item("models/test_m.py"), _Item("integrations/test_i.py")]
    deselected: list = []
    config = SimpleNamespace(args_source=args_source, option=SimpleNamespace(markexpr=markexpr),
                             hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
    select_tiers(config, items)
    name = lambda i: f"{i.path.relative_to(ROOT / 'tests')}{sorted(i.markers)}"  # noqa: E731
    return [name(i) for i in items], [name(i) for i in deselected]


def test_a_bare_run_leaves_out_the_tiers_with_a_command_of_their_own():
    kept, left_out = _select(pytest.Config.ArgsSource.TESTPATHS)
    assert kept == ["test_a.py[]"]
    assert left_out == ["test_a.py['slow']", "models/test_m.py['models']", "integrations/test_i.py['integrations']"]
    assert set(OWN_COMMAND) == {"slow", "models", "integrations"}


@pytest.mark.parametrize("source, markexpr", [(pytest.Config.ArgsSource.ARGS, ""), (pytest.Config.ArgsSource.TESTPATHS, "slow")])
def test_a_path_or_a_marker_expression_chooses_instead(source, markexpr):
    kept, left_out = _select(source, markexpr)
    assert len(kept) == 4 and left_out == []  # -m itself then selects; the folders are still marked
    assert "models/test_m.py['models']" in kept


def _pytest_commands(text: str) -> list[str]:
    return [m.group(0).strip().rstrip(".,;)") for m in re.finditer(r"python -m pytest[^\n#`]*", text)]


def test_ci_runs_readme_test_commands_and_only_documented_ones():
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):readme.index("## Usage")]
    ci = _pytest_commands("\n".join(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.lstrip().startswith("#")))
    commands = _pytest_commands(quick_start.split("```")[1])
    assert "python -m pytest -q --durations=20" in commands and "python -m pytest -q -m slow --durations=20" in commands
    assert set(commands) <= set(ci), "README's quick start runs a test command CI does not"
    documented = {re.sub(r" --durations=\d+", "", c) for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
                  for c in _pytest_commands(path.read_text())}
    assert {re.sub(r" --durations=\d+", "", c) for c in ci} <= documented, "CI runs a test command no page documents"
