"""The backend's options: ``torch.compile(model, backend="autoshard", options={...})``."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

COMPILERS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class Options:
    """Validated backend options.

    compiler: the inner compiler for the rewritten graphs: "inductor", "aot_eager", or
        "eager" (run the captured graph as is, with blocking collectives).
    reshard_after_forward: overrides the value given to ``autoshard.shard`` for every
        parameter; ``None`` keeps each parameter's own.
    debug_dir: write each compiled graph's stages as Python code under this folder.
    """

    compiler: str = "inductor"
    reshard_after_forward: bool | None = None
    debug_dir: str | None = None

    def __post_init__(self) -> None:
        if self.compiler not in COMPILERS:
            raise ValueError(f"autoshard option 'compiler' must be one of {COMPILERS}, got {self.compiler!r}.")
        if self.reshard_after_forward not in (None, True, False):
            raise ValueError(
                f"autoshard option 'reshard_after_forward' must be True, False or None, got {self.reshard_after_forward!r}."
            )
        if self.debug_dir is not None and not isinstance(self.debug_dir, str):
            raise ValueError(f"autoshard option 'debug_dir' must be a path string, got {self.debug_dir!r}.")


def parse_options(options: dict[str, Any] | None) -> Options:
    """Build :class:`Options` from the dict given to ``torch.compile``, rejecting unknown keys."""
    options = dict(options or {})
    valid = [f.name for f in fields(Options)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown autoshard option(s) {unknown}; valid options are {valid}.")
    return Options(**options)
