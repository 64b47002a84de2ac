"""Every snippet of docs/integrations.md (a code block starting ``# snippet: NAME``) runs at 2
gloo ranks, in a folder of its own, as a user would paste it; what it saves is there after."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the integrations tier needs its extra: pip install -e '.[integrations]'")
pytest.importorskip("accelerate", reason="the integrations tier needs its extra: pip install -e '.[integrations]'")
pytest.importorskip("lightning", reason="the integrations tier needs its extra: pip install -e '.[integrations]'")
pytest.importorskip("torchtitan.models.llama3", reason="the integrations tier needs its extra: pip install -e '.[integrations]'")


from autoshard.tools.launch import run_ranks

from launch_env import as_launched, free_port

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
SNIPPETS = dict(re.findall(r"```python\n# snippet: (\w+)\n(.*?)```", DOC.read_text(), flags=re.S))
SAVES = {"hf": "out/final/model.safetensors", "fabric": "ckpt", "trainer": "trainer.ckpt", "torchtitan": "ckpt/.metadata"}


def _run(code: str, folder: str, port: int) -> None:
    """As under torchrun: the environment launchers set, then the snippet as a script."""
    as_launched(port)
    os.chdir(folder)
    exec(compile(code, "docs/integrations.md", "exec"), {"__name__": "__main__"})


def test_the_doc_has_a_snippet_per_framework() -> None:
    assert sorted(SNIPPETS) == sorted(SAVES)


@pytest.mark.parametrize("name", sorted(SAVES))
def test_snippet_runs_at_two_ranks(name: str, tmp_path: Path) -> None:
    run_ranks(2, _run, SNIPPETS[name], str(tmp_path), free_port(), timeout=300)
    assert (tmp_path / SAVES[name]).exists(), sorted(p.name for p in tmp_path.rglob("*"))
