"""A prepared check for the few minutes a GPU is lent: does the sharded GPT compile to Triton,
how fast does it step next to the unsharded one, and how close is the simulator's memory?

One process plays rank 0 of ``--world-size`` ranks on the fake process group: collectives are
shape-correct no-ops (an all-gather returns an uninitialised buffer of the full size), while
compute and memory are real. The repository's GPT (examples/gpt.py) is compiled twice per
precision, with the same inner compiler: "unsharded" (plain ``torch.compile``) and "autoshard"
(``autoshard.shard`` + ``backend="autoshard"``). bf16 rows use
``autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``; their
unsharded twin computes with its float32 parameters cast to bfloat16 the same way.

On the GPU machine (one H200, Python 3.12, torch 2.11, no network), from the repository root::

    python3 -m pip install -q --no-deps --no-build-isolation -e . && \\
        PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --json gpu_check.json

(installing is needed: ``autoshard.passes`` lives in passes/.) CUDA is picked when present:
GPT 6 x 1024 (127M parameters), seq 1024, batch 8, vocab 50304, world size 8, Inductor; four
compiles take most of the time, each system's start is logged to stderr with the seconds so
far. Without a GPU, ``python bench/gpu_check.py`` runs ``--device cpu`` (GPT 2 x 64, seq 32,
batch 2; 1-2 min on 2 cores with Inductor's C++ codegen, ~10 s with ``--compiler aot_eager``).

Columns, one row per precision and system:

    codegen, kernels      the kernels Inductor generated for the step (``triton`` on CUDA,
                          ``cpp`` on CPU; counted in the code it wrote); none under aot_eager
    collectives           collective calls in that generated code: the scheduled graph is
                          what Inductor compiled (0 for the unsharded model)
    step_ms               forward + backward, warm: median of --steps, device synchronised
                          before and after each; gradients are dropped between steps
    step_vs_unsharded     step_ms over the unsharded model's of the same precision, same run
    peak_mib              measured peak memory of one such step. CUDA:
                          ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``
                          (everything allocated on the device: the system's parameters, the
                          batch, cuBLAS workspaces); the other system is freed first. CPU: bytes
                          of parameters and batch + the largest rise of allocated bytes in the
                          step (torch.profiler memory events, bench/real.py's method)
    predicted_peak_mib    the simulator's peak per rank (``Report.metrics["peak_bytes"]``) for
                          the very graphs compiled here; autoshard rows only
    peak_vs_predicted     peak_mib / predicted_peak_mib

--json PATH writes the configuration and every row (also each step's time, the simulator's
step and compute time, compile seconds); it is rewritten after each row, so a run cut short
keeps what it measured. A system that fails is a row with its error and the run goes on;
after the table a line says ``check: ok`` or what failed (then the exit status is 1).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import re
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import autoshard  # noqa: E402
from autoshard._compat import dynamo_counters, fake_process_group, run_and_get_code  # noqa: E402
from autoshard.compiler.dump import recording  # noqa: E402
from autoshard.tools.report.report import Report  # noqa: E402

from gpt import GPT, GPTConfig  # noqa: E402

SYSTEMS = ("unsharded", "autoshard")
PRECISIONS = {"fp32": None, "bf16": autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
# Per device type: a shape that keeps the GPU busy yet compiles 4 times within the lease, and
# a tiny one for CPUs.
PRESETS = {
    "cuda": dict(layers=6, embd=1024, seq=1024, batch=8, vocab=50304, compiler="inductor", steps=10),
    "cpu": dict(layers=2, embd=64, seq=32, batch=2, vocab=96, compiler="inductor", steps=5),
}
TABLE = ("precision", "system", "codegen", "kernels", "collectives", "step_ms", "step_vs_unsharded",
         "peak_mib", "predicted_peak_mib", "peak_vs_predicted")
MIB = 2**20


class CastParams(nn.Module):
    """Runs ``inner`` with its floating-point parameters cast to ``dtype``, keeping them (and
    their gradients) in their own dtype: what MixedPrecision does to a sharded model, unsharded."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, *args: Any) -> Any:
        # Tied parameters appear once here and stay tied in the call (tie_weights defaults on).
        cast = {n: p.to(self.dtype) if p.is_floating_point() else p for n, p in self.inner.named_parameters()}
        return functional_call(self.inner, cast, args)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with shape and compiler defaults filled in from the device's preset."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda (default when present) or cpu")
    parser.add_argument("--layers", type=int, help="GPT blocks (cuda 6, cpu 2)")
    parser.add_argument("--embd", type=int, help="width (cuda 1024, cpu 64)")
    parser.add_argument("--heads", type=int, help="attention heads (default: width / 64, at least 1)")
    parser.add_argument("--seq", type=int, help="sequence length (cuda 1024, cpu 32)")
    parser.add_argument("--batch", type=int, help="sequences per rank (cuda 8, cpu 2)")
    parser.add_argument("--vocab", type=int, help="vocabulary (cuda 50304, cpu 96)")
    parser.add_argument("--world-size", type=int, default=8, help="ranks of the fake process group (default 8)")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), help="inner compiler of both systems (default inductor)")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--steps", type=int, help="timed steps (cuda 10, cpu 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first; the first compiles (default 3)")
    parser.add_argument("--json", metavar="PATH", help="also write the configuration and rows here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device {device}: only cuda and cpu are measured")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # torch.cuda.set_device refuses "cuda" without an index
    args.device = str(device)
    preset = PRESETS[device.type]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.heads = args.heads or max(1, args.embd // 64)
    if args.embd % args.heads:
        parser.error(f"--embd {args.embd} is not divisible by --heads {args.heads}")
    if args.steps < 1 or args.warmup < 1 or args.world_size < 2:
        parser.error("--steps and --warmup must be at least 1, --world-size at least 2")
    return args


def generated(codes: list[str]) -> tuple[Counter, int]:
    """(kernels by kind, collective calls) in the code Inductor wrote. Kernels are defined as
    ``async_compile.<kind>(...)``: ``triton`` on GPUs, ``cpp_pybinding`` on CPUs."""
    kinds = Counter(k for code in codes for k in re.findall(r"async_compile\.(\w+)\(", code) if k != "wait")
    calls = [c for code in codes for c in re.findall(r"_c10d_functional\.(\w+)\.default\(", code)]
    return kinds, sum(1 for c in calls if c != "wait_tensor")


def cpu_peak_bytes(step: Callable[[], None], model: nn.Module, inputs: Sequence[torch.Tensor]) -> int:
    """Bytes live at the step's start (parameters, as this rank holds them, and the batch) plus
    the largest rise of allocated bytes during it, from the profiler's memory events."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.append(str(ROOT / "bench"))  # last: bench/checkpoint.py must shadow nothing
    from real_memory import peak_rise  # the profiler arithmetic bench/real.py measures CPU memory with
    from torch.profiler import ProfilerActivity, profile, record_function

    resident = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())
    resident += sum(t.nbytes for t in inputs)
    # Two steps, the second measured, as in bench/real.py: the profiler misses frees of blocks
    # allocated before it started.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        model.zero_grad(set_to_none=True)
        with record_function("measured_step"):
            step()
    return resident + peak_rise(prof, "measured_step")


def release(device: torch.device) -> float:
    """Free what earlier systems left (compiled code holds their models); the MiB still
    allocated on the device afterwards (CUDA), else 0."""
    torch._dynamo.reset()
    gc.collect()
    if device.type != "cuda":
        return 0.0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device) / MIB


def measure(system: str, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build, compile and measure one system: a row of the table (plus details for --json)."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    row: dict[str, Any] = {"precision": precision, "system": system, "allocated_before_mib": release(device)}
    mp = PRECISIONS[precision]
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    with device:  # weights are made on the device: no host copy of a large model
        model = GPT(cfg)
        x, y = (torch.randint(0, args.vocab, (args.batch, args.seq)) for _ in range(2))
    profile = "h100" if cuda else "cpu"  # the backend's own default; the Report must price alike
    if system == "autoshard":
        autoshard.shard(model, mixed_precision=mp)  # mesh over the fake world, on the model's device
        compiled = torch.compile(model, backend="autoshard", options={"compiler": args.compiler, "profile": profile})
    else:
        compiled = torch.compile(CastParams(model, mp.param_dtype) if mp else model, backend=args.compiler)

    def step() -> None:
        compiled(x, y).backward()

    dynamo_counters.clear()
    start = time.perf_counter()
    with recording() as graphs:  # the forward compiles in the call, the backward in .backward()
        _, codes = run_and_get_code(step)
        sync()
    row["compile_s"] = time.perf_counter() - start
    for _ in range(args.warmup - 1):
        model.zero_grad(set_to_none=True)
        step()
    times = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)  # every step allocates its gradients anew, as the simulator assumes
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    row["graphs"] = dynamo_counters["stats"]["unique_graphs"]  # after the timed steps: any recompilation shows

    model.zero_grad(set_to_none=True)
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        row["resident_mib"] = torch.cuda.memory_allocated(device) / MIB
        step()
        sync()
        row["peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB
    else:
        row["peak_mib"] = cpu_peak_bytes(step, model, (x, y)) / MIB

    kinds, collectives = generated(codes)
    if args.compiler == "inductor":
        row["codegen"] = ", ".join(k.removesuffix("_pybinding") for k in sorted(kinds)) or "none"
        row["kernels"], row["collectives"], row["kernels_by_kind"] = sum(kinds.values()), collectives, dict(kinds)
    row["step_ms"] = statistics.median(times) * 1e3
    row["step_ms_all"] = [t * 1e3 for t in times]
    # The simulator needs the one forward/backward pair; with graph breaks there is no single peak.
    if system == "autoshard" and len(graphs) == 1:
        metrics = Report(graphs[0], profile).metrics
        row["predicted_peak_mib"] = metrics["peak_bytes"] / MIB
        row["peak_vs_predicted"] = row["peak_mib"] / row["predicted_peak_mib"]
        row["predicted_step_ms"] = metrics["step_time"] * 1e3  # comm included; the fake group's cost nothing
        row["predicted_compute_ms"] = metrics["compute_time"] * 1e3
    return row


def _write(path: str | None, args: argparse.Namespace, rows: list[dict], finished: bool) -> None:
    if not path:
        return
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    Path(path).write_text(json.dumps(
        {"config": vars(args), "torch": torch.__version__, "device_name": name, "finished": finished, "rows": rows},
        indent=2, default=str,
    ))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Measure every precision x system, print the table, write --json; returns the rows."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the device mesh, which would pick one itself
    if dist.is_initialized():
        raise RuntimeError("gpu_check brings up its own fake process group: call it with none initialised.")
    rows: list[dict[str, Any]] = []
    begin = time.perf_counter()
    fake_process_group(0, args.world_size)
    try:
        for precision in args.precisions:
            for system in SYSTEMS:
                print(f"[{time.perf_counter() - begin:5.0f} s] {precision} {system} ...", file=sys.stderr, flush=True)
                try:
                    row = measure(system, precision, args)
                except Exception as e:  # noqa: BLE001 - one failing system must not cost the other rows
                    traceback.print_exc()
                    row = {"precision": precision, "system": system, "error": f"{type(e).__name__}: {e}"}
                base = next((r for r in rows if r["precision"] == precision and r["system"] == "unsharded"), row)
                if "step_ms" in row and "step_ms" in base:
                    row["step_vs_unsharded"] = row["step_ms"] / base["step_ms"]
                rows.append(row)
                _write(args.json, args, rows, finished=False)
    finally:
        dist.destroy_process_group()
        release(device)  # the compiled code refers to the fake group
    elapsed = time.perf_counter() - begin

    with torch.device("meta"):  # only the count: no memory
        params = sum(p.numel() for p in GPT(GPTConfig(args.vocab, args.seq, args.layers, args.heads, args.embd)).parameters())
    print(f"GPT {args.layers} x {args.embd} ({params / 1e6:.1f}M parameters), seq {args.seq}, batch {args.batch}/rank, "
          f"world size {args.world_size} (fake process group), {args.device}, compiler {args.compiler}, torch {torch.__version__}; "
          f"step: median of {args.steps} warm forward+backward steps")
    print(tabulate([[r.get(k) for k in TABLE] for r in rows], headers=TABLE, floatfmt=".3f", missingval="n/a"))
    found = problems(rows)
    print("check: " + ("ok" if not found else "FAILED\n  " + "\n  ".join(found)))
    print(f"total {elapsed:.0f} s", file=sys.stderr)
    _write(args.json, args, rows, finished=True)
    return rows


def problems(rows: list[dict[str, Any]]) -> list[str]:
    """What failed the check: a system that raised, a time or peak that is not finite and
    positive, Inductor writing no kernel, a sharded graph without collectives or prediction."""
    found = []
    for r in rows:
        name = f"{r['precision']} {r['system']}"
        if "error" in r:
            found.append(f"{name}: {r['error']}")
            continue
        found += [f"{name}: {k} is {r[k]}" for k in ("step_ms", "peak_mib") if not (math.isfinite(r[k]) and r[k] > 0)]
        if r.get("kernels") == 0:
            found.append(f"{name}: Inductor generated no kernel")
        if r["system"] == "autoshard" and r.get("collectives") == 0:
            found.append(f"{name}: no collective in the generated code")
        if r["system"] == "autoshard" and "predicted_peak_mib" not in r:
            found.append(f"{name}: {r['graphs']} graphs compiled, no single graph for the simulator")
    return found


if __name__ == "__main__":
    sys.exit(1 if problems(main()) else 0)
