"""The backend's options: ``torch.compile(model, backend="autoshard", options={...})``."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from autoshard.runtime.errors import UsageError

COMPILERS = ("inductor", "aot_eager", "eager")
SCHEDULES = ("autoshard", "none", "fsdp2", "inductor")


@dataclass(frozen=True)
class Options:
    """Validated backend options.

    compiler: the inner compiler for the rewritten graphs: "inductor", "aot_eager", or
        "eager" (run the captured graph as is, with blocking collectives).
    reshard_after_forward: overrides the value given to ``autoshard.shard`` for every
        parameter (a bool: ``1`` and ``0`` are refused); ``None`` keeps each parameter's own.
    debug_dir: write each compiled graph's stages as Python code, and its report, under this
        folder (a string or ``os.PathLike`` such as ``pathlib.Path``, kept as a string);
        default: the AUTOSHARD_DEBUG_DIR environment variable, if set.
    schedule: "autoshard" (bucket by module structure, prefetch by the cost model, bounded
        memory); for comparisons on identical graphs: "none" (the lowered graph: gather at
        use, reduce at end), "fsdp2" (FSDP2 eager's policy on the profile's device, same buckets:
        on GPUs prefetch the next one with one reduce-scatter in flight; on CPU ranks, where
        gloo blocks, gather at use in forward, one ahead in backward, each reduction waited
        at once) or "inductor" (PyTorch's own bucketing and overlap scheduler).
    bucket_mb: cap on a bucket's size (MiB); default: one bucket per repeated block, split
        in halves or quarters where that meets the memory budget faster. This and the next
        two take finite positive numbers (NaN and infinity are refused).
    max_inflight_mb: cap on gathered parameters alive at once (MiB), applied before the
        memory budget; default: none.
    memory_budget_gb: per-rank memory (GiB) the schedule must stay within: parameter shards,
        gradients, optimizer state (``optimizer_states`` per parameter), gathered parameters,
        communication buffers and activations, as the step model predicts them. The schedule
        prefetches and keeps reductions in flight only as far as the budget allows; a budget
        too small for any schedule fails the compile naming the smallest that fits. It also
        bounds how many blocks the forward keeps gathered for the backward where
        ``reshard_after_forward`` is left to the default (passes/keep.py). Default: no more
        than FSDP2 eager needs on the same graph and device (see "fsdp2"), and only the last
        block kept.
    optimizer_states: tensors the optimizer keeps per parameter, each the size of its shard
        (2 for Adam and AdamW, 1 for SGD with momentum, 0 for plain SGD), for the budget.
    all_reduce_blocks: the all-reduces of this many consecutive repeated blocks share one
        bucket (hybrid's replica all-reduce, replicate's all-reduce): one ring's latency for k
        blocks, for a bucket k times the size that starts once the k-th block's gradients are
        ready. A whole number >= 1; default 1: one per block. ``autoshard.plan`` may choose it
        on a mixed cluster (``Plan.compile_options``). Without repeated blocks, or under the
        schedules "none" and "inductor" (which do not bucket with autoshard's pass), it changes nothing.
    telemetry: time every collective's wait of the compiled graphs and count its bytes, for
        :class:`autoshard.Telemetry` (an ``autoshard::timed_wait`` before each wait,
        passes/telemetry.py); default False: the graphs carry nothing of it.
    profile: the cost model's device profile for scheduling decisions: a name ("h100",
        "a100", "cpu") or a .json file from ``python -m autoshard calibrate``; default: "h100"
        for graphs on CUDA, "cpu" otherwise.
    """

    compiler: str = "inductor"
    reshard_after_forward: bool | None = None
    debug_dir: str | os.PathLike[str] | None = field(default_factory=lambda: os.environ.get("AUTOSHARD_DEBUG_DIR") or None)
    schedule: str = "autoshard"
    bucket_mb: float | None = None
    max_inflight_mb: float | None = None
    memory_budget_gb: float | None = None
    optimizer_states: int = 2
    profile: str | None = None
    all_reduce_blocks: int = 1
    telemetry: bool = False

    def __post_init__(self) -> None:
        if self.compiler not in COMPILERS:
            raise UsageError(f"autoshard option 'compiler' must be one of {COMPILERS}, got {self.compiler!r}.")
        # A real bool: 1 == True and 0 == False, so ``in (None, True, False)`` would let them through.
        if not (self.reshard_after_forward is None or isinstance(self.reshard_after_forward, bool)):
            raise UsageError(
                f"autoshard option 'reshard_after_forward' must be True, False or None, got {self.reshard_after_forward!r}."
            )
        if self.debug_dir is not None:
            path = os.fspath(self.debug_dir) if isinstance(self.debug_dir, os.PathLike) else self.debug_dir
            if not isinstance(path, str):
                raise UsageError(f"autoshard option 'debug_dir' must be a path string or os.PathLike, got {self.debug_dir!r}.")
            object.__setattr__(self, "debug_dir", path)  # GraphDump and the report read a string
        if self.schedule not in SCHEDULES:
            raise UsageError(f"autoshard option 'schedule' must be one of {SCHEDULES}, got {self.schedule!r}.")
        for name, unit in (("bucket_mb", "MiB"), ("max_inflight_mb", "MiB"), ("memory_budget_gb", "GiB")):
            value = getattr(self, name)
            # NaN <= 0 is False and infinity is positive: both would pass and fail the compile in int().
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
                                      or (isinstance(value, float) and not math.isfinite(value))):
                raise UsageError(f"autoshard option '{name}' must be a positive number of {unit}, got {value!r}.")
        if isinstance(self.optimizer_states, bool) or not isinstance(self.optimizer_states, int) or self.optimizer_states < 0:
            raise UsageError(
                f"autoshard option 'optimizer_states' must be a whole number >= 0 (2 for Adam/AdamW), got {self.optimizer_states!r}."
            )
        if isinstance(self.all_reduce_blocks, bool) or not isinstance(self.all_reduce_blocks, int) or self.all_reduce_blocks < 1:
            raise UsageError(
                f"autoshard option 'all_reduce_blocks' must be a whole number >= 1 (1: one all-reduce per block), "
                f"got {self.all_reduce_blocks!r}."
            )
        if not isinstance(self.telemetry, bool):
            raise UsageError(f"autoshard option 'telemetry' must be True or False, got {self.telemetry!r}.")
        if self.profile is not None:
            from autoshard.cost.cost_model import get_profile

            try:
                get_profile(self.profile)
            except ValueError as e:
                raise UsageError(f"autoshard option 'profile': {e}") from None


def parse_options(options: dict[str, Any] | None) -> Options:
    """Build :class:`Options` from the dict given to ``torch.compile``, rejecting unknown keys."""
    options = dict(options or {})
    valid = [f.name for f in fields(Options)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise UsageError(f"autoshard backend: unknown option(s) {unknown}; valid options are {valid}: "
                         "fix the key(s) in torch.compile(..., options={...}).")
    return Options(**options)
