"""The layering README's layout promises: runtime → passes → compiler → tools, each importing
only the layers before it, and PyTorch internals (``torch._*``) only in ``autoshard/_compat.py``."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["_compat", "runtime", "passes", "compiler", "tools"]  # each may import those before it
FOLDERS = {"runtime": "autoshard/runtime", "passes": "passes", "compiler": "autoshard/compiler", "tools": "autoshard/tools"}


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "autoshard" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _files(layer: str) -> list[Path]:
    return sorted((ROOT / FOLDERS[layer]).glob("*.py"))


def test_each_layer_imports_only_the_layers_before_it():
    wrong = []
    for layer in FOLDERS:
        allowed = set(LAYERS[: LAYERS.index(layer) + 1])
        for path in _files(layer):
            for line, module in _imports(path):
                if module == "autoshard" or ((imported := _layer_of(module)) is not None and imported not in allowed):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, "a layer reaches a later one:\n" + "\n".join(wrong)


def test_torch_internals_only_through_compat():
    wrong = []
    for layer in FOLDERS:
        for path in _files(layer):
            for line, module in _imports(path):
                if any(part.startswith("_") and not part.startswith("__") for part in module.split(".")[1:]) and module.startswith("torch"):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, "PyTorch internals outside autoshard/_compat.py:\n" + "\n".join(wrong)


def test_every_module_sits_in_a_layer():
    top = {p.name for p in (ROOT / "autoshard").glob("*.py")}
    assert top == {"__init__.py", "__main__.py", "_compat.py"}, top
