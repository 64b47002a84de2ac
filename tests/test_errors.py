"""One convention for every error a user can meet: ``"<where>: <what is wrong>; <how to fix it>."``,
raised as one of autoshard's types (``autoshard.errors``: a usage mistake is a ``UsageError``).

``<where>`` names what the user called (``autoshard.shard``, ``autoshard option 'bucket_mb'``,
``autoshard explain``, ...). The first tests read the source, not the behaviour: they walk every
``raise X("...")`` / ``raise X(f"...")`` in ``autoshard/`` and ``passes/`` and check the static start of
the message against :data:`WHERE` and ``X`` against the error types. Raises that are not user-facing
errors of their own are listed in :data:`INTERNAL`, builtin errors a user can meet in
:data:`BUILTIN`, each with the reason. The last tests make the mistakes and catch them by type.
"""
from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

import autoshard
from autoshard.cost.cost_model import get_profile
from autoshard.runtime import errors
from autoshard.runtime.errors import (
    AutoshardError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    UsageError,
    UsageTypeError,
)
from autoshard.runtime.grad_sync import set_requires_gradient_sync

from fake_pg import fake_world

ROOT = Path(__file__).resolve().parents[1]

# What a message may start with: the API, option or command the user called.
WHERE = (
    "autoshard.shard: ",
    "autoshard.save: ",
    "autoshard.load: ",
    "autoshard.full_state_dict: ",
    "autoshard.explain: ",  # also autoshard.explain_graphs, which shares its checks
    "autoshard.materialize: ",
    "autoshard.MixedPrecision: ",
    "autoshard.Compression: ",
    "autoshard.transformers_tp_plan: ",
    "autoshard.gpt_tp_plan: ",
    "autoshard.Report: ",
    "autoshard.tools.launch.run_ranks: ",
    "autoshard.cost.simulator.analyze: ",
    "autoshard.cost.allocator: ",  # replay(capacity=...) and reserved.reserved_memory(capacity=...)
    "autoshard.cost.simulator.kwh_per_million_tokens: ",
    "set_requires_gradient_sync: ",
    "autoshard option '",  # a backend option: "autoshard option 'bucket_mb' must be ..."
    "autoshard backend: ",  # compiling failed, not because of one option (ranks' plans differ, unknown options)
    "autoshard calibrate: ",  # the command lines
    "autoshard explain: ",
    "autoshard plan: ",
    "autoshard.plan: ",
    "autoshard.set_batch_shares: ",
    "autoshard.split_batch: ",
    "autoshard.batch_sizes: ",
    "autoshard.Cluster: ",
    "set_gradient_divide_factor: ",
    "AutoshardTrainer: ",  # autoshard.integrations: the class the user named
    "AutoshardFabricStrategy",  # ": " or ".save_checkpoint: ", ".load_checkpoint: "
    "AutoshardStrategy: ",
    "autoshard.integrations.torchtitan: ",  # the module named on torchtitan's command line
    "autoshard.Telemetry: ",
    "autoshard report: ",
)

# (file, enclosing function, exception) -> why its message need not start with a WHERE.
INTERNAL = {
    ("autoshard/runtime/layout.py", "local_chunk", "UsageError"):
        "internal: shard refuses state shares with tensor parallelism and hybrid before any layout is cut",
    ("autoshard/runtime/strided_state.py", "stored_placements", "UsageError"):
        "internal: autoshard.shard never lays a dimension out twice strided (a strided tp weight stays whole over dp)",
    ("autoshard/runtime/batched.py", "key_for", "RuntimeError"):
        "internal: two batches whose 80-bit hashes collide; an autoshard bug to report, not a user's call",
    ("passes/schedule.py", "_untimed", "AssertionError"):
        "internal: apply_plan's compute-time stand-in; placing a given plan never prices a node",
    ("autoshard/_compat/inductor.py", "schedule_overlap_bucketing", "ValueError"):
        "internal: only passes/inductor_schedule.py calls it, with compute_estimator='analytical' and pre-bucketing off",
    ("autoshard/cost/cost_model.py", "collective_time", "ValueError"):
        "internal: the kinds come from graph_utils.collective_kind and calibrate, never from a user",
    ("autoshard/compiler/pipeline.py", "check_order", "ValueError"):
        "internal: checked at import; a developer's misordered pass list (tests/test_pipeline.py), not a user's call",
    ("autoshard/cost/cost_model.py", "get_profile", "UsageError"):
        "a suffix: the user names a profile through the option, and options.py raises \"autoshard option 'profile': <this>\"",
    ("autoshard/runtime/checkpoint.py", "find_class", "pickle.UnpicklingError"):
        "wrapped by _read_checked: \"autoshard.load: checkpoint P: cannot read .metadata: <this>; ...\"",
    ("autoshard/tools/explain.py", "load_factory", "FileNotFoundError"):
        "wrapped at once: \"autoshard explain: cannot load F from P: FileNotFoundError: <this>\"",
    ("autoshard/integrations/torchtitan.py", "__getattr__", "AttributeError"):
        "Python's own form for a module attribute (\"module 'M' has no attribute 'N'\"): torchtitan's --config lookup reads it",
    ("autoshard/tools/explain.py", "_shape", "argparse.ArgumentTypeError"):
        "argparse frames it: \"autoshard explain: error: argument --input-shape: <this>\"",
}

# Raises a user can meet that are builtin errors, not autoshard's types (every other one not in
# INTERNAL is an AutoshardError: a usage mistake a UsageError): (file, function, exception) -> why.
BUILTIN = {
    ("autoshard/tools/launch.py", "run_ranks", "RuntimeError"):
        "what happened while running: a launched rank failed; its own error, shown first, says why",
    ("autoshard/tools/launch.py", "run_ranks", "TimeoutError"):
        "what happened while running: ranks still running at the timeout (a hang, or a slow job)",
    ("autoshard/compiler/consistency.py", "_wait_for_plans", "RuntimeError"):
        "what happened while running: not every rank compiled the graph before the timeout",
    ("passes/unbatch.py", "unbatch_annotations", "ValueError"):
        "internal: a pass before unbatch_annotations read a batch whole; the pipeline's order, not a user's call",
}

# Messages that start with an argument naming the API: (file, argument) -> the functions that
# take it as their first argument; every call of those must pass a literal WHERE.
DYNAMIC = {
    ("autoshard/runtime/fail_together.py", "what"): ("fail_together", "check_same_on_all_ranks"),
    ("autoshard/tools/explain.py", "caller"): ("load_factory", "input_maker"),  # the command line's checks, shared
    ("autoshard/runtime/batch_shares.py", "what"): ("normalize",),  # shard, set_batch_shares, split_batch, batch_sizes
}


def _sources() -> list[Path]:
    return sorted([*(ROOT / "autoshard").rglob("*.py"), *(ROOT / "passes").rglob("*.py")])


class _Raises(ast.NodeVisitor):
    """Every ``raise X(...)`` with its enclosing function's name."""

    def __init__(self) -> None:
        self.function = ["<module>"]
        self.found: list[tuple[str, ast.Raise]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.function.append(node.name)
        self.generic_visit(node)
        self.function.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Raise(self, node: ast.Raise) -> None:
        if isinstance(node.exc, ast.Call):  # not a re-raise (`raise`, `raise error`)
            self.found.append((self.function[-1], node))
        self.generic_visit(node)


def _parts(message: ast.expr) -> list[ast.expr] | None:
    """The message as a sequence of constant and formatted parts, from its start; None when
    its start is not a string literal."""
    if isinstance(message, ast.BinOp) and isinstance(message.op, ast.Add):
        return _parts(message.left)
    if isinstance(message, ast.Constant) and isinstance(message.value, str):
        return [message]
    if isinstance(message, ast.JoinedStr):
        return list(message.values)
    return None


def _problem(path: str, function: str, raise_: ast.Raise) -> str | None:
    call = raise_.exc
    if not call.args:
        return "no message"
    parts = _parts(call.args[0])
    if parts is None:
        return f"a message that starts with no string: {ast.unparse(call.args[0])[:60]}"
    if parts and isinstance(parts[0], ast.FormattedValue):
        name = ast.unparse(parts[0].value)
        after = parts[1].value if len(parts) > 1 and isinstance(parts[1], ast.Constant) else ""
        if (path, name) in DYNAMIC and after.startswith(": "):
            return None
        return f"starts with {{{name}}}"
    start = "".join(p.value for p in itertools.takewhile(lambda p: isinstance(p, ast.Constant), parts))
    if start.startswith(WHERE):
        return None
    return f"starts with {start[:60]!r}"


def _all_raises() -> list[tuple[str, str, str, ast.Raise]]:
    found = []
    for file in _sources():
        visitor = _Raises()
        visitor.visit(ast.parse(file.read_text(), str(file)))
        path = file.relative_to(ROOT).as_posix()
        found += [(path, function, ast.unparse(r.exc.func), r) for function, r in visitor.found]
    return found


def test_every_error_message_starts_with_where_it_was_raised():
    raises = _all_raises()
    assert len(raises) > 50  # the walk found the sources
    bad = []
    for path, function, exception, raise_ in raises:
        if (path, function, exception) in INTERNAL:
            continue
        problem = _problem(path, function, raise_)
        if problem is not None:
            bad.append(f"{path}:{raise_.lineno} ({function}) {exception}: {problem}")
    assert not bad, (
        "error messages must read '<where>: <what is wrong>; <how to fix it>.', <where> one of tests/test_errors.py's "
        "WHERE (or list the raise in INTERNAL, with the reason):\n" + "\n".join(bad)
    )


def test_every_internal_exemption_still_exists():
    present = {(path, function, exception) for path, function, exception, _ in _all_raises()}
    assert not set(INTERNAL) - present, f"stale INTERNAL entries: {sorted(set(INTERNAL) - present)}"
    assert {path for path, _ in DYNAMIC} <= {path for path, _, _ in present}


def test_apis_that_name_themselves_in_messages_are_given_a_where():
    """``fail_together(what)``, ``check_same_on_all_ranks(what, ...)`` and
    ``normalize(..., what=...)`` start their messages with ``what``: every call passes a
    literal that is a WHERE."""
    takers = {name for names in DYNAMIC.values() for name in names}
    calls = []
    for file in _sources():
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if func in takers:
                    calls.append((file.relative_to(ROOT).as_posix(), node))
    assert len(calls) >= 3  # autoshard.save, autoshard.load, autoshard.shard
    for path, call in calls:
        named = [k.value for k in call.keywords if k.arg == "what"]  # normalize(..., what=...)
        what = named[0] if named else call.args[0] if call.args else None
        if path in ("autoshard/runtime/fail_together.py", "autoshard/runtime/batch_shares.py") \
                and isinstance(what, ast.Name) and what.id == "what":
            continue  # passing its own argument on
        assert isinstance(what, ast.Constant) and f"{what.value}: ".startswith(WHERE), f"{path}:{call.lineno}: {ast.unparse(call)}"


def _error_types() -> set[str]:
    return {name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, AutoshardError)}


def test_every_user_facing_raise_is_one_of_autoshards_error_types():
    protocol = ("__getattr__", "AttributeError")  # a module's or class's __getattr__ must raise it
    bad = [f"{path}:{raise_.lineno} ({function}) {exception}" for path, function, exception, raise_ in _all_raises()
           if exception not in _error_types() and (path, function, exception) not in {**INTERNAL, **BUILTIN}
           and (function, exception) != protocol]
    assert not bad, ("raise one of autoshard.errors' types (a usage mistake: UsageError; a checkpoint autoshard.load "
                     "cannot take: CheckpointError), or list the raise in INTERNAL or BUILTIN with the reason:\n" + "\n".join(bad))
    present = {(path, function, exception) for path, function, exception, _ in _all_raises()}
    assert not set(BUILTIN) - present, f"stale BUILTIN entries: {sorted(set(BUILTIN) - present)}"


def test_the_error_types_keep_the_builtins_they_replaced():
    """``except ValueError`` (``TypeError``, ``FileNotFoundError``, ``RuntimeError``) in user code
    still catches what autoshard raised as that builtin before it had types."""
    assert issubclass(UsageError, ValueError) and issubclass(UsageTypeError, (UsageError, TypeError))
    assert issubclass(CheckpointError, ValueError) and issubclass(CheckpointNotFoundError, (CheckpointError, FileNotFoundError))
    assert issubclass(CheckpointReadError, (CheckpointError, RuntimeError))
    assert autoshard.CheckpointError is CheckpointError and "CheckpointError" in autoshard.__all__


# The mistakes themselves, one or more per module that raises them: caught by type, then by words.

def test_shard_mistakes_are_usage_errors():
    with pytest.raises(UsageError, match=r"^autoshard\.shard: strategy must be one of"):
        autoshard.shard(nn.Linear(2, 2), strategy="sideways")
    with pytest.raises(UsageError, match=r"^autoshard\.shard: reshard_after_forward must be True, False, None or an int"):
        autoshard.shard(nn.Linear(2, 2), reshard_after_forward=1.0)
    with pytest.raises(UsageError, match=r"^autoshard\.shard: mixed_precision must be an autoshard\.MixedPrecision"):
        autoshard.shard(nn.Linear(2, 2), mixed_precision=torch.bfloat16)


def test_mixed_precision_mistakes_are_usage_errors():
    with pytest.raises(UsageError, match=r"^autoshard\.MixedPrecision: param_dtype must be a floating-point torch\.dtype"):
        autoshard.MixedPrecision(param_dtype=torch.int32)


def test_materialize_mistakes_are_usage_errors():
    with pytest.raises(UsageError, match=r"^autoshard\.materialize: Linear is not sharded; call autoshard\.shard"):
        autoshard.materialize(nn.Linear(2, 2), "cpu")


def test_gradient_sync_mistakes_are_usage_errors():
    with pytest.raises(UsageError, match=r"^set_requires_gradient_sync: requires_gradient_sync must be True or False"):
        set_requires_gradient_sync([nn.Linear(2, 2)], 1)


def test_profile_mistakes_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match=r"^unknown device profile 'tpu9'; use one of"):
        get_profile("tpu9")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(UsageError, match=r"^cannot read device profile .*broken\.json.*autoshard calibrate --out"):
        get_profile(str(tmp_path / "broken.json"))


def test_explain_mistakes_are_usage_errors():
    with pytest.raises(UsageTypeError, match=r"^autoshard\.explain: expected an nn\.Module or a callable returning one, got int"):
        autoshard.explain(3, torch.zeros(1, 2))
    with fake_world(2), pytest.raises(UsageError, match=r"^autoshard\.explain: a process group is initialised"):
        autoshard.explain(lambda: nn.Linear(2, 2), torch.zeros(1, 2))


def test_save_mistakes_are_usage_errors(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(UsageTypeError, match=r"^autoshard\.save: extra must be a dict with str keys, got list"):
        autoshard.save(tmp_path / "ckpt", model, extra=[1])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(UsageError, match=r"^autoshard\.save: .*notes exists and is not an autoshard checkpoint"):
        autoshard.save(tmp_path / "notes", model)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_a_checkpoint_load_cannot_take_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"^autoshard\.load: no checkpoint at"):
        autoshard.load(tmp_path / "nowhere", nn.Linear(2, 2))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"^autoshard\.load: .*empty is not a complete autoshard checkpoint"):
        autoshard.load(tmp_path / "empty", nn.Linear(2, 2))
    autoshard.save(tmp_path / "ckpt", nn.Linear(2, 2))
    other = nn.Linear(2, 3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"does not match the model/optimizer: mismatched \(2\): model\.bias"):
        autoshard.load(tmp_path / "ckpt", other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # unchanged
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match=r"\.metadata is missing, truncated or corrupted \(checksum differs\)"):
        autoshard.load(tmp_path / "ckpt", nn.Linear(2, 2))
