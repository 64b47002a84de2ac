"""Compile time of autoshard next to plain ``torch.compile``, by phase, at several depths.

The repository's GPT (examples/gpt.py, width 64, 4 heads, sequence 64, batch 2) is compiled
for one training step (forward + backward) twice per depth and inner compiler: "plain" (the
unsharded model under ``torch.compile(backend=compiler)``) and "autoshard" (``autoshard.shard``
at world size 8 on the fake process group, ``backend="autoshard"`` with the same inner
compiler). Each compile runs in a fresh process with its own empty Inductor cache, FX-graph and
AOT-autograd caches off, after a warm-up compile of a small plain model (so neither side pays
for loading torch.compile's modules)::

    python bench/compile_time.py                      # 4, 16, 48 layers; aot_eager and inductor
    python bench/compile_time.py --layers 16 --compilers aot_eager --repeat 3 --json ct.json

Phases (seconds, each exclusive of the others):

    dynamo      Dynamo tracing the forward (the first call, less the forward's run time)
    capture     AOT autograd: tracing the joint forward+backward graph, and the rest of the
                backend that is none of the phases below
    autoshard   autoshard's passes and stage bookkeeping (pipeline.run)
    partition   the min-cut partitioner
    inner       the inner compiler (Inductor's joint passes and compile_fx_inner; ~0 for aot_eager)
    total       the first step, less a steady step: the compile time a user waits for

``vs_plain`` is autoshard's total over plain's from the same run; with ``--repeat N`` each
system's fastest of N compiles (alternating which runs first) is kept.

``--warm``: restart time instead. Per depth, inner compiler and system, one process compiles
with an empty cache directory (cold), then a second process, the same code, model and cache
directory, compiles again (warm), FX-graph and AOT-autograd caches on as PyTorch ships them;
``warm_vs_plain`` is autoshard's warm total over plain's; with ``--repeat N``, N warm
processes per system (taking turns), the fastest kept::

    python bench/compile_time.py --warm --repeat 3 --layers 4 16 48 --compilers aot_eager inductor

``--calls``: Python function calls per phase (millions, cProfile) instead of seconds: slower,
but a count repeats from run to run where this machine's times move by tens of percent::

    python bench/compile_time.py --calls --compilers aot_eager --layers 4 16
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

PHASES = ("dynamo", "capture", "autoshard", "partition", "inner")
SYSTEMS = ("plain", "autoshard")
COMPILERS = ("aot_eager", "inductor")
WIDTH = dict(n_embd=64, n_head=4, block_size=64, vocab_size=96)
BATCH = 2


class PhaseClock:
    """Exclusive seconds per phase: time spent in a phase nested in another counts only for
    the inner one. ``count_calls``: also Python function calls per phase, one profiler per
    phase, running only while that phase is the innermost."""

    def __init__(self, count_calls: bool = False) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[tuple[str, list[float]]] = []  # per open phase: name, [start, seconds in nested phases]
        self._profiles: dict[str, cProfile.Profile] | None = defaultdict(cProfile.Profile) if count_calls else None

    def calls(self) -> dict[str, int]:
        return {name: sum(s[1] for s in p.getstats()) for name, p in (self._profiles or {}).items()}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._switch(self._stack[-1][0] if self._stack else None, name)
        frame = [time.perf_counter(), 0.0]
        self._stack.append((name, frame))
        try:
            yield
        finally:
            self._stack.pop()
            total = time.perf_counter() - frame[0]
            self.seconds[name] += total - frame[1]
            if self._stack:
                self._stack[-1][1][1] += total
            self._switch(name, self._stack[-1][0] if self._stack else None)

    def _switch(self, old: str | None, new: str | None) -> None:
        if self._profiles is None:
            return
        if old is not None:
            self._profiles[old].disable()
        if new is not None:
            self._profiles[new].enable()

    def wrap(self, fn: Callable, name: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)

        return timed


@contextlib.contextmanager
def _timed_pipeline(clock: PhaseClock) -> Iterator[dict[str, float]]:
    """Time autoshard's pipeline (phase "autoshard") and, by pass name, each pass in it."""
    from autoshard.compiler import pipeline

    per_pass: dict[str, float] = defaultdict(float)

    def timed_pass(step: Any) -> Any:
        def run(gm: Any, ctx: Any) -> Any:
            start = time.perf_counter()
            try:
                return step.run(gm, ctx)
            finally:
                per_pass[step.name] += time.perf_counter() - start

        return dataclasses.replace(step, run=run) if isinstance(step, pipeline.Pass) else step

    saved = {k: getattr(pipeline, k) for k in ("CAPTURED", "JOINT", "PARTITIONED", "run")}
    try:
        for k in ("CAPTURED", "JOINT", "PARTITIONED"):
            setattr(pipeline, k, tuple(map(timed_pass, saved[k])))
        pipeline.run = clock.wrap(saved["run"], "autoshard")
        yield per_pass
    finally:
        for k, v in saved.items():
            setattr(pipeline, k, v)


def _model(layers: int, **width: int) -> Any:
    import torch

    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, **width))


def _step(compiled: Callable, idx: Any) -> tuple[float, float]:
    start = time.perf_counter()
    loss = compiled(idx, idx)
    mid = time.perf_counter()
    loss.backward()
    return mid - start, time.perf_counter() - mid


def measure(system: str, compiler: str, layers: int, world_size: int = 8, count_calls: bool = False) -> dict[str, Any]:
    """Compile one training step of the GPT at ``layers`` with ``system`` and ``compiler``,
    in this process; seconds per phase (see the module docstring), or with ``count_calls``
    millions of Python calls per phase."""
    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard._compat import fake_process_group, lookup_backend, wrap_compile_phases
    from autoshard.compiler.backend import autoshard_backend

    # Warm-up: load what any first torch.compile loads, on a shape that shares no kernels.
    warm = _model(1, n_embd=32, n_head=2, block_size=16, vocab_size=50)
    _step(torch.compile(warm, backend=compiler), torch.zeros(1, 16, dtype=torch.long))
    torch._dynamo.reset()

    fake_process_group(0, world_size)
    try:
        model = _model(layers, **WIDTH)
        if system == "autoshard":
            autoshard.shard(model)
            backend = functools.partial(autoshard_backend, options={"compiler": compiler})
        else:
            backend = lookup_backend(compiler)
        clock = PhaseClock(count_calls)
        compiled = torch.compile(model, backend=clock.wrap(backend, "capture"))
        idx = torch.randint(0, WIDTH["vocab_size"], (BATCH, WIDTH["block_size"]))
        with wrap_compile_phases(clock.wrap), _timed_pipeline(clock) as per_pass:
            with clock.phase("forward call"):
                loss = compiled(idx, idx)
            with clock.phase("backward call"):
                loss.backward()
        steady = [_step(compiled, idx) for _ in range(3)]
        fwd, bwd = min(s[0] for s in steady), min(s[1] for s in steady)
    finally:
        dist.destroy_process_group()
    if count_calls:  # the steady steps ran outside every phase: nothing to take off
        s, fwd, bwd = defaultdict(float, {k: v / 1e6 for k, v in clock.calls().items()}), 0.0, 0.0
    else:
        s = clock.seconds
    phases = {
        "dynamo": s["forward call"] - fwd,
        # The backward call beyond its run time is AOT autograd's lazy backward compile.
        "capture": s["capture"] + max(0.0, s["backward call"] - bwd),
        "autoshard": s["autoshard"],
        "partition": s["partition"],
        "inner": s["inner"],
    }
    return {"system": system, "compiler": compiler, "layers": layers, **phases, "total": sum(phases.values()),
            "passes": dict(per_pass), "steady_fwd_s": fwd, "steady_bwd_s": bwd}


def _child(system: str, compiler: str, layers: int, world_size: int, cache: str, caches_on: bool,
           count_calls: bool = False) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore"}
    for var in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        if caches_on:
            env.pop(var, None)  # as PyTorch ships them
        else:
            env[var] = "0"
    cmd = [sys.executable, __file__, "--child", system, compiler, str(layers), str(world_size)] + ["--calls"] * count_calls
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{system} {compiler} {layers} layers failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_in_child(system: str, compiler: str, layers: int, world_size: int, count_calls: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        return _child(system, compiler, layers, world_size, cache, False, count_calls)


def run_warm(layers: list[int], compilers: list[str], world_size: int, repeat: int = 1) -> list[dict[str, Any]]:
    """Per depth and inner compiler, each system cold then warm (two processes, one cache
    directory). With ``repeat`` N, N warm processes per system, the systems taking turns (which
    goes first alternates), and each system's fastest kept: on a shared machine one process's
    time moves by more than the difference being measured."""
    rows = []
    for compiler in compilers:
        for n in layers:
            got: dict[str, dict[str, float]] = {s: {} for s in SYSTEMS}
            runs: dict[str, list[float]] = {s: [] for s in SYSTEMS}
            with tempfile.TemporaryDirectory() as plain_cache, tempfile.TemporaryDirectory() as autoshard_cache:
                caches = dict(zip(SYSTEMS, (plain_cache, autoshard_cache)))
                rounds = [("cold", SYSTEMS)] + [("warm", SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]) for r in range(repeat)]
                for when, order in rounds:
                    for system in order:
                        print(f"{compiler} {n} layers {system} {when} ...", end=" ", file=sys.stderr, flush=True)
                        total = _child(system, compiler, n, world_size, caches[system], True)["total"]
                        print(f"{total:.2f} s", file=sys.stderr, flush=True)
                        got[system][when] = min(total, got[system].get(when, float("inf")))
                        runs[system].append(total)
            for system in SYSTEMS:  # warm_runs: every warm process's total, in order (the spread)
                rows.append({"compiler": compiler, "layers": n, "system": system, **got[system],
                             "warm_vs_plain": got[system]["warm"] / got["plain"]["warm"], "warm_runs": runs[system][1:]})
    return rows


def run(layers: list[int], compilers: list[str], repeat: int, world_size: int, count_calls: bool = False) -> list[dict[str, Any]]:
    rows = []
    for compiler in compilers:
        for n in layers:
            best: dict[str, dict] = {}
            for r in range(repeat):
                for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                    print(f"{compiler} {n} layers {system} ...", end=" ", file=sys.stderr, flush=True)
                    row = _measure_in_child(system, compiler, n, world_size, count_calls)
                    print(f"{row['total']:.2f} {'M calls' if count_calls else 's'}", file=sys.stderr, flush=True)
                    if system not in best or row["total"] < best[system]["total"]:
                        best[system] = row
            best["autoshard"]["vs_plain"] = best["autoshard"]["total"] / best["plain"]["total"]
            best["plain"]["vs_plain"] = 1.0
            rows += [best["plain"], best["autoshard"]]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", nargs="+", type=int, default=[4, 16, 48])
    parser.add_argument("--compilers", nargs="+", choices=COMPILERS, default=list(COMPILERS))
    parser.add_argument("--repeat", type=int, default=1, help="compiles (--warm: warm restarts) per system and size; fastest kept")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--calls", action="store_true", help="count Python calls per phase instead of timing it")
    parser.add_argument("--warm", action="store_true", help="cold then warm compile (2nd process, same cache directory)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--child", nargs=4, metavar=("SYSTEM", "COMPILER", "LAYERS", "WORLD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        system, compiler, layers, world = args.child
        print(json.dumps(measure(system, compiler, int(layers), int(world), args.calls)))
        return

    from tabulate import tabulate

    if args.warm:
        rows = run_warm(args.layers, args.compilers, args.world_size, args.repeat)
        print(f"GPT width {WIDTH['n_embd']}, seq {WIDTH['block_size']}, batch {BATCH}; autoshard at world size "
              f"{args.world_size} (fake process group); seconds of the first training step's compile, in a process "
              "with an empty cache directory (cold) and in a second one with the same directory (warm)")
        cols = ["compiler", "layers", "system", "cold", "warm", "warm_vs_plain"]
        print(tabulate([[r[c] for c in cols] for r in rows], headers=cols, floatfmt=".2f"))
        if args.json:
            Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))
        return
    rows = run(args.layers, args.compilers, args.repeat, args.world_size, args.calls)
    unit = "millions of Python calls" if args.calls else "seconds"
    print(f"GPT width {WIDTH['n_embd']}, seq {WIDTH['block_size']}, batch {BATCH}; autoshard at world size "
          f"{args.world_size} (fake process group); {unit} per phase of the first training step's compile")
    cols = ["compiler", "layers", "system", *PHASES, "total", "vs_plain"]
    print(tabulate([[r[c] for c in cols] for r in rows], headers=cols, floatfmt=".3f" if args.calls else ".2f"))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
