"""Measured step time and peak memory of DDP, FSDP2 and autoshard on real gloo ranks (CPU).

Starts ``world`` CPU processes on gloo for each world size and sets up the same small GPT with
each system. Their timed steps then take turns, one step of each system per round, with what
the set-up systems hold frozen out of the garbage collector's scans; so a machine whose load
comes and goes slows every system alike, and no system pays for the others' objects. Per
rank it measures the median step time (forward + backward + AdamW step) and the peak memory
of one steady-state step. ``fsdp2_compile`` takes its turns apart, after the others (see
:data:`APART`). For the autoshard rows it also plays the compiled forward/backward graphs on
the cost model (``autoshard.cost.simulator``) and compares the prediction with the measured
forward + backward time, twice: with the profile as given (``pred_error``), and with its
compute figures measured again in the same ranks before the runs (``pred_error_in_run``),
which separates the simulator's error from the profile's drift (other load, ranks sharing
cores):

    python bench/real.py                                   # GPT 4 x 128, seq 128, worlds 2 and 4
    python bench/real.py --world-sizes 2 --steps 20 --json real.json
    python bench/real.py --profile cpu                     # cost-model profile for the prediction
    python bench/real.py --systems autoshard simplefsdp_block --world-sizes 2

SimpleFSDP rows (torchtitan's compiler-based FSDP, bench/simple_fsdp.py; the ``bench`` extra):
``simplefsdp`` without a bucketing pass, ``simplefsdp_auto`` and ``simplefsdp_block`` with
graph_trainer's automatic and per-block manual bucketing/reordering, all on "aot_eager";
``simplefsdp_inductor*`` (not run by default: Inductor's C++ compile takes minutes here) the same
on "inductor". Both passes need CUDA for their runtime estimates; on CPU they run with
``simple_fsdp.cpu_estimates`` (see there). Without torchtitan the rows are skipped with a
one-line reason. ``autoshard_iso*`` is autoshard given the memory SimpleFSDP needs: its
``memory_budget_gb`` is a peak SimpleFSDP measured in the same run (each variant's highest over
the ranks, profiled after its warm-up: every system then warms up two steps more, so losses stay
step for step comparable): ``autoshard_iso`` the lowest of every variant's, ``autoshard_iso_auto``
and ``autoshard_iso_block`` that variant's; where autoshard cannot fit it, the row is skipped
saying so. The summary compares each with the variants whose memory it has. Every system's
losses are compared with the first system's (``parity``): the same initial weights and batches
give the same losses to 1e-5.

Compiled systems use the "aot_eager" compiler (Inductor spends minutes compiling C++ on a
small CPU box), so compiled and eager rows run the same ATen kernels.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from real_memory import MEMORY_METHOD, profiled_peak, state_bytes  # noqa: E402

import autoshard  # noqa: E402
from autoshard._compat import dynamo_counters as counters  # noqa: E402
from autoshard.compiler.dump import recording  # noqa: E402
from autoshard.cost.cost_model import DeviceProfile, get_profile  # noqa: E402
from autoshard.cost.simulator import analyze  # noqa: E402
from autoshard.runtime.errors import over_budget_in  # noqa: E402
from autoshard.tools.calibrate import measure as calibrate  # noqa: E402
from autoshard.tools.launch import run_ranks  # noqa: E402

import simple_fsdp  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from real_summary import TABLE, parity_lines, prediction_lines, ratio_lines, rows_of, sanity_lines, verdict_lines  # noqa: E402

OURS = ("ddp", "fsdp2", "fsdp2_compile", "autoshard_none", "autoshard")
KEEP = ("autoshard_keep",)  # SimpleFSDP's choice, like for like: not resharding after forward
SIMPLE_FSDP = tuple(simple_fsdp.VARIANTS)
# autoshard given the memory SimpleFSDP needs: memory_budget_gb is the lowest peak the SimpleFSDP
# rows named here measured in this run (each variant's worst rank), so its step answers "as fast
# at that memory?": autoshard_iso at every variant's (the lowest), the others at one variant's.
ISO = {
    "autoshard_iso": SIMPLE_FSDP,
    "autoshard_iso_auto": ("simplefsdp_auto",),
    "autoshard_iso_block": ("simplefsdp_block",),
}
# (autoshard row, SimpleFSDP row) pairs the summary compares: each iso row with the variants whose
# memory it has (the verdict's), and the default and autoshard_keep with every variant.
ISO_PAIRS = [(mine, rival) for mine, rivals in ISO.items() for rival in rivals]
PAIRS = [(mine, rival) for mine in ("autoshard",) + KEEP for rival in SIMPLE_FSDP] + ISO_PAIRS
SYSTEMS = OURS + KEEP + tuple(ISO) + SIMPLE_FSDP
DEFAULT_SYSTEMS = OURS + ("simplefsdp", "simplefsdp_auto", "simplefsdp_block") + tuple(ISO)


# --- one function per system: wrap a freshly built GPT, return (callable, module owning the parameters)


def setup_ddp(model: GPT, args: argparse.Namespace) -> tuple:
    # Every rank holds full parameters, gradients and optimizer state; gradients are all-reduced
    # in buckets during backward.
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    return ddp, ddp


def _fully_shard(model: GPT) -> GPT:
    # As FSDP2 users do: each transformer block is its own unit (gathered and freed as one),
    # the root (embeddings, final norm, tied head) last.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def setup_fsdp2(model: GPT, args: argparse.Namespace) -> tuple:
    model = _fully_shard(model)
    return model, model


def setup_fsdp2_compile(model: GPT, args: argparse.Namespace) -> tuple:
    # As FSDP2 users compile: FSDP2's hooks are dynamo-disabled, so the root's loop over blocks
    # graph-breaks at each block; each block's forward is compiled (one graph, reused by all),
    # embeddings, head and loss run eagerly.
    model = _fully_shard(model)
    return torch.compile(model, backend=args.fsdp2_compile_backend), model


def _setup_autoshard(model: GPT, schedule: str, reshard_after_forward: bool | None = None, **options) -> tuple:
    # The backend's own "profile" option keeps its default ("cpu" off CUDA); --profile only
    # changes the profile the prediction below is made with.
    autoshard.shard(model, reshard_after_forward=reshard_after_forward)
    options = {"compiler": "aot_eager", "schedule": schedule, **options}
    return torch.compile(model, backend="autoshard", options=options), model


def setup_autoshard_none(model: GPT, args: argparse.Namespace) -> tuple:
    return _setup_autoshard(model, "none")


def setup_autoshard(model: GPT, args: argparse.Namespace) -> tuple:
    return _setup_autoshard(model, "autoshard")


def setup_autoshard_keep(model: GPT, args: argparse.Namespace) -> tuple:
    # Gathered parameters kept from forward to backward (ZeRO-2 within the step, parameters
    # sharded between steps), as SimpleFSDP does: no gathers in backward, more memory.
    return _setup_autoshard(model, "autoshard", reshard_after_forward=False)


def sizes_simple_fsdp(args: argparse.Namespace) -> bool:
    """Whether SimpleFSDP's peak is measured after its warm-up (for autoshard_iso's budget)."""
    return any(s in ISO for s in args.systems)


def setup_autoshard_iso(model: GPT, args: argparse.Namespace) -> tuple:
    return _setup_autoshard(model, "autoshard", memory_budget_gb=args.iso_budget_gb)  # set per row by run_systems


SETUPS = {name: globals()[f"setup_{name}"] for name in OURS + KEEP}
SETUPS.update((name, setup_autoshard_iso) for name in ISO)
SETUPS.update((name, lambda model, args, name=name: simple_fsdp.setup(name, model)) for name in SIMPLE_FSDP)


# --- measurement, on every rank


def train_step(model, optimizer, x, y, losses: list | None = None) -> tuple[float, float]:
    """One step; returns (forward + backward seconds, whole-step seconds); appends the loss to ``losses``."""
    dist.barrier()  # start together: otherwise a rank's time includes waiting for the slowest
    t0 = time.perf_counter()
    loss = model(x, y)
    loss.backward()  # gradients are reduced (and waited for) before backward returns
    t1 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    if losses is not None:
        losses.append(loss.detach())
    return t1 - t0, t2 - t0


def in_run_profile(name: str) -> DeviceProfile:
    """``name``'s profile with its compute figures measured now, in these ranks (averaged over
    them): the prediction then sees the compute speed this run gets (cores shared by the
    ranks, other load), so its error is the simulator's own, not the profile's drift."""
    figures = calibrate.compute_figures(repeats=5)
    keys = sorted(figures)
    values = torch.tensor([figures[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(values)
    averaged = dict(zip(keys, (values / dist.get_world_size()).tolist()))
    return calibrate.with_compute(get_profile(name), averaged, f"{name} with compute measured in this run")


class Trained:
    """One system, set up and warmed up on this rank: what its timed and measured steps need."""

    def __init__(self, system: str, args: argparse.Namespace) -> None:
        rank = dist.get_rank()
        graphs_before = counters["stats"]["unique_graphs"]
        torch.manual_seed(0)  # same initial weights on every rank and for every system
        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
        self.system = system
        self.losses: list[torch.Tensor] = []
        # SimpleFSDP's backend sets global Inductor options when built, read when it compiles (in
        # the first step): kept to its own set-up; its passes estimate with simple_fsdp.cpu_estimates.
        simple = system in SIMPLE_FSDP
        with simple_fsdp.inductor_config_kept() if simple else contextlib.nullcontext():
            with simple_fsdp.cpu_estimates(args.profile) if simple else contextlib.nullcontext():
                self._set_up(system, cfg, args, rank, graphs_before)

    def _set_up(self, system: str, cfg: GPTConfig, args: argparse.Namespace, rank: int, graphs_before: int) -> None:
        self.model, self.module = SETUPS[system](GPT(cfg), args)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-3)  # after sharding: it sees the shards
        g = torch.Generator().manual_seed(rank)  # each rank its own slice of the global batch
        self.x, self.y = (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(2))
        start = time.perf_counter()
        with recording() as self.graphs:  # compile happens in the first step (backward graph in its backward)
            self.step()
        for _ in range(args.warmup - 1):
            self.step()
        if sizes_simple_fsdp(args):  # every system the same steps, so losses stay comparable
            if system in SIMPLE_FSDP:
                self.sizing_peak = profiled_peak(self.step, state_bytes(self.model, self.module, self.optimizer))
            else:
                for _ in range(2):
                    self.step()
        self.warmup_s = time.perf_counter() - start
        self.compiled_graphs = counters["stats"]["unique_graphs"] - graphs_before  # Dynamo graphs (0: eager)
        self.times: list[tuple[float, float]] = []

    def step(self) -> tuple[float, float]:
        return train_step(self.model, self.optimizer, self.x, self.y, self.losses)


def measure_memory(t: Trained, args: argparse.Namespace, in_run: DeviceProfile) -> dict:
    """``t``'s timed steps summarised, and its peak memory and predictions measured now."""
    persistent = state_bytes(t.model, t.module, t.optimizer)
    peak = profiled_peak(t.step, persistent)
    result = {
        "fwd_bwd_s": statistics.median(f for f, _ in t.times),
        "step_s": statistics.median(s for _, s in t.times),
        "state_bytes": persistent,
        "peak_bytes": peak,
        "warmup_s": t.warmup_s,
        "graphs": t.compiled_graphs,
        "losses": [float(v) for v in t.losses],
    }
    if t.system.startswith("autoshard"):
        # Forward + backward only: the simulator does not model the optimizer step. With graph
        # breaks the graphs run one after another, so their predictions add up.
        analyses = [analyze(s["forward"], s["backward"], args.profile) for s in t.graphs]
        result["predicted_s"] = sum(a.step_time for a in analyses)
        result["predicted_in_run_s"] = sum(analyze(s["forward"], s["backward"], in_run).step_time for s in t.graphs)
        result["predicted_compute_s"] = sum(a.compute_time for a in analyses)
        result["predicted_comm_s"] = sum(a.comm_time for a in analyses)
        result["predicted_peak_bytes"] = max(a.peak_bytes for a in analyses)
    return result


def measure(system: str, args: argparse.Namespace, in_run: DeviceProfile) -> dict:
    """One system on its own: set up, ``args.steps`` timed steps, memory (bench/memory.py's
    budget sweep measures each plan this way)."""
    torch._dynamo.reset()
    counters.clear()
    t = Trained(system, args)
    t.times = [t.step() for _ in range(args.steps)]
    return measure_memory(t, args, in_run)


# Dynamo skips GPT.forward for good once it graph-breaks in its loop over blocks (as FSDP2's
# dynamo-disabled hooks make it do), so a later compile of another GPT would break at every
# block: fsdp2_compile is set up and timed apart, after the others.
APART = ("fsdp2_compile",)


def iso_budget_gb(trained: list[Trained], variants: tuple[str, ...]) -> float | None:
    """The lowest peak (GiB) the rows of ``variants`` measured while warming up, each variant's
    highest over the ranks (as the table reports it): the same on every rank; None if none ran."""
    peaks = torch.tensor([float(t.sizing_peak) for t in trained if t.system in variants], dtype=torch.float64)
    if not len(peaks):  # every rank runs the same systems: all return here
        return None
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return peaks.min().item() / 2**30


def run_systems(args: argparse.Namespace) -> dict[str, dict]:
    """This rank's measurements of every system in ``args.systems``. The systems are set up
    first; their timed steps then take turns (one step of each per round, the order
    rotating), so load that comes and goes on the machine slows every system alike instead of
    whichever ran at the time. Systems in :data:`APART` take their turns among themselves, after."""
    world = dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the machine's cores
    in_run = in_run_profile(args.profile)
    results = {}
    together = [s for s in args.systems if s not in APART]
    for group in (together, *([s] for s in args.systems if s in APART)):
        if not group:
            continue
        torch._dynamo.reset()
        counters.clear()
        trained = []
        for system in sorted(group, key=lambda s: s in ISO):  # the budget comes from the others
            if system in ISO:
                args.iso_budget_gb = iso_budget_gb(trained, ISO[system])
                if args.iso_budget_gb is None:
                    if dist.get_rank() == 0:
                        print(f"world {world} {system} skipped: its budget is the peak of {' or '.join(ISO[system])}, "
                              "which did not run", flush=True)
                    continue
            try:
                trained.append(Trained(system, args))
            except Exception as e:  # Dynamo wraps the backend's error; only a budget too small is a result
                if system not in ISO or (over := over_budget_in(e)) is None:
                    raise
                if dist.get_rank() == 0:  # every rank compiled the same graphs within the same budget
                    print(f"world {world} {system} skipped: the SimpleFSDP peak it is given "
                          f"({args.iso_budget_gb * 2**10:.1f} MiB) is below the least autoshard's memory model plans for "
                          f"({over.smallest_bytes / 2**20:.1f} MiB)", flush=True)
                continue
            if dist.get_rank() == 0:
                t = trained[-1]
                print(f"world {world} {system:15s} warm-up {t.warmup_s:6.1f} s ({t.compiled_graphs} graphs)",
                      file=sys.stderr, flush=True)
        # What the set-up systems keep alive is not scanned by the collections a step triggers:
        # otherwise a system that makes more garbage per step (FSDP2's hooks) pays for the others'.
        gc.collect()
        gc.freeze()
        for i in range(args.steps):
            for t in trained[i % len(trained):] + trained[: i % len(trained)]:
                t.times.append(t.step())
        gc.unfreeze()
        results.update((t.system, measure_memory(t, args, in_run)) for t in trained)
        del trained
    if dist.get_rank() == 0:
        for system in (s for s in args.systems if s in results):
            print(f"world {world} {system:15s} step {results[system]['step_s'] * 1e3:7.1f} ms (rank 0)", file=sys.stderr, flush=True)
    return {s: results[s] for s in args.systems if s in results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=96)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS),
                        help="default: all but simplefsdp_inductor* (Inductor's C++ compile takes minutes on CPU)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every world this many times (fresh ranks); ratios are summarised over the runs")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps first: compilation in the first, optimizer state created by its step")
    parser.add_argument("--fsdp2-compile-backend", default="aot_eager", help="torch.compile backend of fsdp2_compile")
    parser.add_argument("--profile", default="cpu", help="cost-model profile for the prediction (see cost_model.get_profile)")
    parser.add_argument("--json", help="also write the rows and the configuration to this file")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.repeat < 1:
        parser.error("--warmup, --steps and --repeat must be at least 1")
    if (why := simple_fsdp.missing()) and any(s in SIMPLE_FSDP for s in args.systems):
        print(why)
        args.systems = [s for s in args.systems if s not in SIMPLE_FSDP]
    if any(s in ISO for s in args.systems) and not any(s in SIMPLE_FSDP for s in args.systems):
        print("autoshard_iso* skipped: their memory budgets are SimpleFSDP rows' measured peaks, and none runs")
        args.systems = [s for s in args.systems if s not in ISO]
    if sizes_simple_fsdp(args) and args.warmup < 2:
        parser.error("autoshard_iso* need --warmup 2 or more: SimpleFSDP's peak is measured after its warm-up")

    start = time.perf_counter()
    rows = []
    for run in range(1, args.repeat + 1):
        for world in args.world_sizes:
            rows += [{**row, "run": run} for row in rows_of(world, run_ranks(world, run_systems, args, timeout=None), args.systems)]
    elapsed = time.perf_counter() - start

    params = sum(p.numel() for p in GPT(GPTConfig(args.vocab, args.seq, args.layers, args.heads, args.embd)).parameters())
    print(f"GPT {args.layers} layers x {args.embd}, {params / 1e6:.2f}M parameters, seq {args.seq}, batch {args.batch}/rank; "
          f"gloo on CPU, {args.steps} timed steps after {args.warmup} warm-up; compiled rows use "
          f"{args.fsdp2_compile_backend} (fsdp2_compile) / aot_eager (autoshard, simplefsdp*) / inductor (simplefsdp_inductor*)")
    print("step_ms, fwd_bwd_ms: max over ranks of each rank's median; peak_mib: max over ranks. Memory: " + MEMORY_METHOD)
    print(tabulate([[r[k] for k in TABLE] for r in rows], headers=TABLE, floatfmt=".3f", missingval=""))
    steps = args.warmup + args.steps + 2 + (2 if sizes_simple_fsdp(args) else 0)
    for line in (*parity_lines(rows, args.systems, steps), *prediction_lines(rows, args.profile),
                 *ratio_lines(rows, PAIRS), *verdict_lines(rows, ISO_PAIRS), *sanity_lines(rows)):
        print(line)
    print(f"total {elapsed:.0f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "memory_method": MEMORY_METHOD, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
