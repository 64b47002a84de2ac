"""``autoshard.__all__`` is the public API: each name documented in README.md or docs/, none of
them a module or an internal (the backend function, the launcher, the annotation ops)."""
from __future__ import annotations

import re
import types
from pathlib import Path

import autoshard

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INTERNAL = {"autoshard_backend", "launch", "ops", "shards_in_place", "checkpoint"}


def undocumented(names: list[str], texts: list[str]) -> list[str]:
    """The names no text writes as ``autoshard.<name>``, ``autoshard.errors.<name>`` or in code
    as `` `<name>` `` / `` `<name>(...)` ``."""
    return [n for n in names if not any(re.search(rf"\bautoshard\.(errors\.)?{re.escape(n)}\b|`{re.escape(n)}[`(.]", t) for t in texts)]


def test_every_public_name_is_documented():
    assert undocumented(autoshard.__all__, [p.read_text() for p in DOCS]) == []


def test_the_documentation_check_can_fail():
    assert undocumented(["shard", "UsageError", "nowhere"], ["autoshard.shard(model) raises `UsageError`"]) == ["nowhere"]


def test_the_public_api_holds_no_module_and_no_internal():
    assert not [n for n in autoshard.__all__ if isinstance(getattr(autoshard, n), types.ModuleType)]
    assert not INTERNAL & set(autoshard.__all__)
    assert callable(autoshard.full_tensor)  # state shares' whole tensors (DTensor.full_tensor assumes even rows)


def test_star_import_gives_exactly_all():
    names: dict = {}
    exec("from autoshard import *", names)
    assert set(names) - {"__builtins__"} == set(autoshard.__all__)
