"""Errors as types (autoshard/runtime/errors.py): planning decides "does not fit" by the
error's type, never by ``except ValueError`` or a message's text, so a bug raised inside a
trial surfaces instead of reading as "does not fit"."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import fx

import autoshard
from autoshard.compiler import bucket_plan
from autoshard.compiler.bucket_plan import choose_bucket_mb
from autoshard.compiler.options import parse_options
from autoshard.passes import schedule_overlap
from autoshard.passes.graph_utils import collective_kind, nbytes
from autoshard.passes.schedule import PLAN
from autoshard.passes.schedule_config import ScheduleConfig
from autoshard.runtime.errors import AutoshardError, InflightCapError, OverBudgetError, UsageError, over_budget_in
from autoshard.tools.plan import plan as plan_module

from pass_graphs import Stack, bucketed, matmuls_take_one, stage


def _comm(per_largest: float) -> Callable[[fx.Node], float]:
    sizes = [nbytes(n) for n in bucketed("forward").graph.nodes if collective_kind(n) == "all_gather"]
    return lambda n: 0.05 + per_largest * nbytes(n) / max(sizes)


def _schedule(comm: Callable[[fx.Node], float]) -> Callable[[fx.GraphModule, "int | None"], None]:
    def schedule(gm: fx.GraphModule, budget: int | None) -> None:
        schedule_overlap(gm, ScheduleConfig(matmuls_take_one, comm), memory_budget_bytes=budget, no_more_than=(1, 1))

    return schedule


def _smallest_block_bytes(comm: Callable[[fx.Node], float]) -> int:
    blocks = bucketed("forward")
    _schedule(comm)(blocks, None)
    return blocks.meta[PLAN].smallest_bytes


def test_a_budget_no_schedule_meets_raises_over_budget_error_still_a_value_error():
    comm = _comm(2.0)
    smallest = _smallest_block_bytes(comm)
    with pytest.raises(OverBudgetError, match="is below what this graph needs") as caught:
        choose_bucket_mb(stage(Stack, "forward"), _schedule(comm), smallest // 4)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, AutoshardError)
    assert caught.value.smallest_bytes is not None and caught.value.smallest_bytes > smallest // 4


def test_an_inflight_cap_no_schedule_meets_raises_inflight_cap_error():
    with pytest.raises(InflightCapError, match="option 'max_inflight_mb'") as caught:
        schedule_overlap(bucketed("forward"), ScheduleConfig(matmuls_take_one, lambda n: 1.5), max_inflight_bytes=1)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("bug", [ValueError("a bug in the trial"), KeyError("a bug in the trial")])
@pytest.mark.parametrize("fail_on", ["blocks", "splits"])
def test_a_bug_inside_a_bucket_plan_trial_surfaces_instead_of_reading_as_does_not_fit(bug, fail_on):
    """A user budget below what block buckets need makes the planner try split buckets; a
    plain ValueError (or any other) from a trial is a bug, not "does not fit"."""
    comm = _comm(2.0)
    budget = _smallest_block_bytes(comm) - 1  # block buckets do not fit, split ones do
    real = _schedule(comm)
    calls = []

    def buggy(gm: fx.GraphModule, budget: int | None) -> None:
        calls.append(gm)
        if fail_on == "blocks" or len(calls) > 1:
            raise bug
        real(gm, budget)

    # Without the bug the planner finds split buckets that fit.
    mb, plan, _ = choose_bucket_mb(stage(Stack, "forward"), real, budget)
    assert mb is not None and plan.peak_bytes <= budget
    with pytest.raises(type(bug), match="a bug in the trial"):
        choose_bucket_mb(stage(Stack, "forward"), buggy, budget)


def test_the_planner_catches_only_the_does_not_fit_types():
    assert set(bucket_plan.DOES_NOT_FIT) == {OverBudgetError, InflightCapError}


def test_over_budget_is_read_by_type_through_dynamos_wrapper():
    """over_budget_in (tools/plan/plan.py, bench/real.py) finds the schedule's OverBudgetError inside the errors wrapping it, by
    type: a ValueError with the same words is not one."""
    inner = OverBudgetError("autoshard option 'memory_budget_gb': 1.000 GiB is below ...", smallest_bytes=123)
    wrapper = RuntimeError("backend failed")
    wrapper.inner_exception = inner  # as Dynamo's BackendCompilerFailed holds it
    assert over_budget_in(wrapper) is inner
    outer = RuntimeError("outer")
    outer.__cause__ = wrapper
    assert over_budget_in(outer).smallest_bytes == 123
    lookalike = ValueError("autoshard option 'memory_budget_gb': 1.000 GiB is below what this graph needs")
    assert over_budget_in(lookalike) is None


def test_plan_message_matching_is_gone():
    source = (plan_module.__file__, bucket_plan.__file__)
    for path in source:
        text = open(path).read()
        assert "in str(" not in text, path
        assert "except ValueError:" not in text and "except ValueError as" not in text.replace(
            "except ValueError as e:  # UsageError, OverBudgetError, ...", ""), path


def test_bad_options_raise_usage_error():
    with pytest.raises(UsageError, match="option 'schedule'") as caught:
        parse_options({"schedule": "nope"})
    assert isinstance(caught.value, ValueError)
    with pytest.raises(UsageError, match="unknown option"):
        parse_options({"nope": 1})


def test_error_types_are_exported():
    assert autoshard.errors.OverBudgetError is OverBudgetError
    assert autoshard.OverBudgetError is OverBudgetError and autoshard.UsageError is UsageError
    import autoshard.errors as errors

    assert errors.RankFailedError is autoshard.RankFailedError and errors.PlanMismatchError is autoshard.PlanMismatchError


# Files that still raise a plain ValueError, each with why. A new file raising one fails the test:
# a usage mistake is a UsageError (tests/test_errors.py checks every raise's type).
PLAIN_VALUE_ERRORS = {
    "autoshard/_compat/inductor.py": "a torch release's missing hook, not the user's mistake",
    "autoshard/compiler/pipeline.py": "a pass declared without what it requires: autoshard's own bug",
    "autoshard/cost/cost_model.py": "collective_time's unknown kind: the kinds come from autoshard, never a user",
    "passes/unbatch.py": "a batch the pass cannot split: autoshard's own bug",
}


def _plain_value_error_files(root: Path) -> set[str]:
    found = set()
    for path in [*(Path(root) / "autoshard").rglob("*.py"), *(Path(root) / "passes").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name)
                    and node.exc.func.id == "ValueError"):
                found.add(path.relative_to(root).as_posix())
    return found


def test_usage_mistakes_raise_usage_error_not_a_plain_value_error(tmp_path):
    root = Path(__file__).resolve().parents[1]
    assert _plain_value_error_files(root) <= set(PLAIN_VALUE_ERRORS)
    (tmp_path / "autoshard").mkdir()
    (tmp_path / "passes").mkdir()
    (tmp_path / "autoshard" / "new.py").write_text("def f(x):\n    raise ValueError(f'autoshard.f: bad {x}')\n")
    assert _plain_value_error_files(tmp_path) == {"autoshard/new.py"}  # the check sees one


def test_the_tools_usage_mistakes_are_usage_errors():
    from autoshard.cost.simulator import kwh_per_million_tokens
    from autoshard.tools.calibrate.measure import measure

    mistakes = [
        (lambda: autoshard.explain(lambda: torch.nn.Linear(2, 2), torch.zeros(1, 2), world_size=0), "world_size must be a positive int"),
        (lambda: autoshard.Report({}, "cpu"), "at least the 'forward' stage"),
        (lambda: measure([1]), "world sizes must be >= 2"),
        (lambda: kwh_per_million_tokens(1.0, 0, 1), "must be positive"),
    ]
    for call, message in mistakes:
        with pytest.raises(UsageError, match=message):
            call()
