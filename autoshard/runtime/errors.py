"""autoshard's errors, as types: code catches the one it means, never a message's text.

Each subclasses the builtin it replaced (``ValueError`` for what the user asked for,
``RuntimeError`` for what happened while running), so ``except ValueError`` in user code keeps
working; messages keep the convention: which component, what is wrong, what to do.
"""
from __future__ import annotations


class AutoshardError(Exception):
    """Base of every error autoshard raises on purpose."""


class UsageError(AutoshardError, ValueError):
    """A bad argument or option: a value, a combination or a model autoshard cannot take."""


class UsageTypeError(UsageError, TypeError):
    """A :class:`UsageError` where a ``TypeError`` was raised before (an argument of the wrong
    type): ``except TypeError`` keeps catching it."""


class OverBudgetError(AutoshardError, ValueError):
    """No schedule (or plan) fits the memory budget. ``smallest_bytes``: the least that fits,
    when known."""

    def __init__(self, message: str, smallest_bytes: int | None = None) -> None:
        super().__init__(message)
        self.smallest_bytes = smallest_bytes


def over_budget_in(error: BaseException | None) -> OverBudgetError | None:
    """The schedule's :class:`OverBudgetError` inside ``error``, or None: Dynamo wraps what a
    backend raises (``BackendCompilerFailed.inner_exception``), other code chains it (``__cause__``)."""
    while error is not None:
        if isinstance(error, OverBudgetError):
            return error
        error = error.__cause__ or getattr(error, "inner_exception", None)
    return None


class InflightCapError(AutoshardError, ValueError):
    """No schedule keeps the gathered parameters in flight under ``max_inflight_mb``."""


class PlanMismatchError(AutoshardError, RuntimeError):
    """Ranks compiled different communication plans for one graph: running it would hang."""


class RankFailedError(AutoshardError, RuntimeError):
    """Another rank failed (compiling or in a collective step); this one stops too."""


class CheckpointError(AutoshardError, ValueError):
    """A checkpoint ``autoshard.load`` cannot take: incomplete, corrupted (a file's size or
    checksum differs), not written by ``autoshard.save``, or not matching the model/optimizer
    (missing, unexpected or mismatched keys). The model and optimizer are left unchanged."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the path given to ``autoshard.load``."""


class CheckpointReadError(CheckpointError, RuntimeError):
    """Reading a checkpoint that passed every check failed (DCP's error inside); the model and
    optimizer are left unchanged."""
