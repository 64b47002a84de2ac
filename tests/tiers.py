"""The test tiers: markers registered in pyproject.toml, applied here."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A folder that is a tier marks its tests; a bare run (no paths, no -m) leaves out the tiers that
# have their own command in README, so `python -m pytest -q` is the quick default; naming a file
# or folder, or `-m`, chooses instead.
FOLDER_TIERS = {"models": "models", "integrations": "integrations"}
OWN_COMMAND = ("slow", "models", "integrations")


def select_tiers(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test in a tier's folder with the tier; in a bare run, deselect the tiers with
    a command of their own (tests/conftest.py's collection hook)."""
    for item in items:
        folder = Path(str(item.path)).relative_to(ROOT / "tests").parts[0]
        if folder in FOLDER_TIERS:
            item.add_marker(FOLDER_TIERS[folder])
    if config.args_source is not pytest.Config.ArgsSource.TESTPATHS or config.option.markexpr:
        return
    left_out = [item for item in items if any(item.get_closest_marker(tier) for tier in OWN_COMMAND)]
    if left_out:
        skipped = set(left_out)
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in skipped]
