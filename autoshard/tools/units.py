"""Bytes, times and energy as people read them: what the report, the planner and the
benchmarks print with (one place, so every table writes a number the same way)."""
from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, three significant digits."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def byte_unit(n: float) -> tuple[str, int]:
    """The unit :func:`fmt_bytes` writes ``n`` in, and its size: an axis reads in one unit."""
    return next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if abs(n) >= s), ("B", 1))


def fmt_time(s: float) -> str:
    """``s`` seconds in s, ms, us or ns, four significant digits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.4g} {unit}"
    return f"{s * 1e9:.4g} ns"


def fmt_energy(joules: float) -> str:
    """``joules`` in J, kJ, MJ or GJ, three significant digits."""
    for unit, scale in (("GJ", 1e9), ("MJ", 1e6), ("kJ", 1e3)):
        if abs(joules) >= scale:
            return f"{joules / scale:.3g} {unit}"
    return f"{joules:.3g} J"
