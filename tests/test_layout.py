"""The layering README's layout promises: runtime → passes → cost → compiler → tools, each importing
only the layers before it; PyTorch internals (``torch._*``, imported or reached by attribute)
only in ``autoshard/_compat/``; no import circle among autoshard's modules; every subpackage
walked. Modules over :data:`MAX_LINES` lines are a guideline, not a rule: each is named in a
:class:`LongModuleWarning` (pytest's warnings summary; ``python tests/test_layout.py`` lists
them), so a file is split along a seam of its idea, never to meet a count."""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["_compat", "runtime", "passes", "cost", "compiler", "tools", "integrations"]  # each may import those before it
FOLDERS = {"runtime": "autoshard/runtime", "passes": "passes", "cost": "autoshard/cost", "compiler": "autoshard/compiler",
           "tools": "autoshard/tools", "integrations": "autoshard/integrations"}


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
    return sorted((ROOT / FOLDERS[layer]).rglob("*.py"))  # rooms (subpackages) too


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
    assert top == {"__init__.py", "__main__.py"}, top
    folders = {p.name for p in (ROOT / "autoshard").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {"_compat", *FOLDERS} - {"passes"}, folders


# Attributes of torch's op objects that are private (``op._schema``): read them through _compat.
PRIVATE_OP_ATTRIBUTES = {"_schema", "_overloadpacket", "_opname", "_overloadname", "_op", "_qualified_op_name"}


def _torch_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the torch module path it is bound to (``import torch.distributed as dist``)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    names[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "torch":
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _private_torch_attributes(path: Path) -> list[str]:
    """``torch._ops.OpOverload``, ``dist._foo``, ``op._schema``, ``getattr(op, "_schema")`` in ``path``.
    Op names (``torch.ops.aten._unsafe_view``) are public, whatever their spelling."""
    tree = ast.parse(path.read_text())
    names, found = _torch_names(tree), []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_OP_ATTRIBUTES:
                found.append(f"{where}:{node.lineno} .{node.attr}")
            chain, root = [], node
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in names:
                full = names[root.id].split(".") + chain[::-1]
                full = full[: full.index("ops")] if "ops" in full else full
                if any(part.startswith("_") and not part.startswith("__") for part in full[1:]):
                    found.append(f"{where}:{node.lineno} {'.'.join(names[root.id].split('.') + chain[::-1])}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in PRIVATE_OP_ATTRIBUTES):
            found.append(f"{where}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_torch_private_attributes_only_through_compat():
    wrong = [hit for layer in FOLDERS for path in _files(layer) for hit in _private_torch_attributes(path)]
    assert not wrong, "PyTorch internals reached by attribute outside autoshard/_compat/:\n" + "\n".join(sorted(set(wrong)))


def test_the_attribute_check_sees_private_access(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nimport torch.distributed as dist\nfrom torch import fx\n"
                      "a = torch._ops.OpOverload\nb = dist._functional\nc = fx._symbolic_trace\nd = op._schema\n"
                      "e = getattr(op, '_schema', None)\nf = torch.ops.aten._unsafe_view.default\ng = torch.nn.Linear\n")
    found = {hit.split(" ", 1)[1] for hit in _private_torch_attributes(sample)}
    assert found == {"torch._ops.OpOverload", "torch._ops", "torch.distributed._functional", "torch.fx._symbolic_trace", "._schema",
                     "getattr(..., '_schema')"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "passes":  # published at the top level, imported as autoshard.passes
        parts = ["autoshard", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """autoshard module -> the autoshard modules it imports (anywhere in the file: under
    TYPE_CHECKING and inside functions too)."""
    paths = {_module_name(p): p for p in [*(ROOT / "autoshard").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                imported |= {base, *(f"{base}.{a.name}" for a in node.names)}
        graph[module] = {m for m in imported if m in paths and m != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    graph = _import_graph()
    assert "autoshard.tools.report.report" in graph and "autoshard.passes.schedule" in graph  # the graph covers both trees
    assert not _cycles(graph), "modules that import each other (through others, maybe):\n" + "\n".join(map(str, _cycles(graph)))


def test_the_circle_check_finds_circles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


MAX_LINES = 400


class LongModuleWarning(UserWarning):
    """A module over :data:`MAX_LINES` lines: worth a look for a seam, not a failure."""


def long_modules() -> dict[str, int]:
    """Each module of autoshard/ and passes/ (subpackages too) over :data:`MAX_LINES` lines -> its lines."""
    return {str(p.relative_to(ROOT)): n for p in sorted([*(ROOT / "autoshard").rglob("*.py"), *(ROOT / "passes").rglob("*.py")])
            if (n := len(p.read_text().splitlines())) > MAX_LINES}


def test_long_modules_are_named_not_failed():
    for path, lines in long_modules().items():
        warnings.warn(f"{path}: {lines} lines (guideline {MAX_LINES}): split it where its ideas part, if they do",
                      LongModuleWarning, stacklevel=1)


def test_a_long_module_warns_and_rooms_are_walked(monkeypatch):
    monkeypatch.setitem(globals(), "MAX_LINES", 30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        test_long_modules_are_named_not_failed()
    named = [str(w.message) for w in caught if w.category is LongModuleWarning]
    assert any(m.startswith("autoshard/tools/report/") for m in named)  # a module in a room (subpackage)
    assert any(m.startswith("passes/") for m in named)


if __name__ == "__main__":
    for path, lines in long_modules().items():
        print(f"{path}: {lines} lines (guideline {MAX_LINES})")
