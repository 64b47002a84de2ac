"""Measured, not predicted: per-rank telemetry of a real training run (opt-in).

    model = torch.compile(model, backend="autoshard", options={"telemetry": True})
    telemetry = autoshard.Telemetry(model, path="run.jsonl", tensorboard="runs/a")
    for batch in loader:
        with telemetry.step(tokens=batch.numel()):
            loss = model(batch); loss.backward(); optimizer.step(); optimizer.zero_grad()
    telemetry.close()
    # autoshard report run.jsonl --html run.html

What each rank measures per step: the step's wall time; the time spent waiting in each kind of
collective (all-gather, reduce-scatter, all-reduce: the exposed communication, which is where a
fast rank spends the time a slow one makes it wait); the bytes each kind moved (each
collective's full buffer, the cost model's convention); its peak memory (the device
allocator's on GPUs, the process's resident set on CPU); and the tokens it trained. Busy time
is the step less its waits. The option ``telemetry`` makes the backend time every wait of the
compiled graphs (passes/telemetry.py: an ``autoshard::timed_wait`` before each wait, which
waits and records); the accumulation flush's blocking reductions are timed here too.

Every ``every`` steps (and at ``close``) the ranks exchange their records (one all-gather of a
small float tensor: every rank must call ``step`` alike, as every rank runs the same loop), and
rank 0 writes them: one JSON line per step with every rank's figures, and TensorBoard scalars
(torch's own ``SummaryWriter``, which needs the ``tensorboard`` package). ``summary()`` gives
the seed's KPIs from them (see :func:`kpis`).

On CUDA the wait is timed on the device (CUDA events around it on the current stream: how long
the compute stream stalled), read at the step's end; on CPU (gloo) by the wall clock, where a
wait blocks the calling thread.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from autoshard._compat import all_gather_single
from autoshard.runtime import adaptive_shares, timed_waits
from autoshard.runtime.batch_shares import ADAPTIVE, batch_sizes, set_batch_shares, shares_of
from autoshard.runtime.errors import UsageError
from autoshard.runtime.timed_waits import KINDS

# One record's fields, in the order the ranks exchange them.
FIELDS = ("step_s", *(f"wait_{k}_s" for k in KINDS), *(f"bytes_{k}" for k in KINDS), "peak_bytes", "tokens")


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # The process's peak resident set: kilobytes on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class Telemetry:
    """Per-rank measurements of a training run with autoshard: see the module docstring.

    Args:
        model: the sharded model (compiled with ``options={"telemetry": True}``).
        path: a JSON-lines file rank 0 writes (None: none).
        tensorboard: a TensorBoard log folder rank 0 writes scalars to (None: none).
        every: steps between the ranks' exchanges of their records (and writes).
        price_per_hour: each rank's price in dollars per hour (one number for all, or one per
            rank), for throughput per dollar; power_w: each rank's power draw in watts, for energy
            per step (e.g. a device profile's ``busy_power_w``).
        prediction: what ``autoshard.explain`` predicted for this job (its ``Report``, or a dict
            with ``step_s`` and ``overlap``), written beside the measurements.
        adapt_shares: re-split the global batch of ``global_batch`` samples at every exchange
            from each rank's measured busy time (:mod:`autoshard.runtime.adaptive_shares`;
            ``damping``, ``min_change``, ``jump``); feed each rank ``autoshard.split_batch(batch, model)``.
    """

    def __init__(self, model: nn.Module, *, path: str | os.PathLike[str] | None = None, tensorboard: str | None = None,
                 every: int = 10, price_per_hour: float | list[float] | None = None, power_w: float | list[float] | None = None,
                 prediction: Any = None, adapt_shares: bool = False, global_batch: int | None = None,
                 damping: float = 0.5, min_change: int = 1, jump: float | None = 1.25) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UsageError(f"autoshard.Telemetry: every must be a whole number >= 1, got {every!r}.")
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.price = _per_rank(price_per_hour, self.world, "price_per_hour")
        self.power = _per_rank(power_w, self.world, "power_w")
        params = list(model.parameters())
        self.parameters = sum(p.numel() for p in params)  # DTensors count their global size
        self.device = params[0].device if params else torch.device("cpu")
        self.every, self.steps, self.pending, self.rows = every, 0, [], []
        self.waits_seen = 0  # timed waits in the last step (0: the graphs were compiled without the option)
        self.prediction = _prediction(prediction)
        self.model, self.damping, self.min_change, self.jump = model, damping, min_change, jump
        self.sizes: list[int] | None = None  # the adaptive split, samples per rank (None: shares not adapted)
        if adapt_shares:
            adaptive_shares.check(global_batch, self.world, damping, min_change, jump)
            current = shares_of(model)
            self.sizes = batch_sizes(current, global_batch) if current else batch_sizes([1] * self.world, global_batch)
            set_batch_shares(model, self.sizes)
            setattr(model, ADAPTIVE, True)
        self.path = os.fspath(path) if path is not None else None
        self.writer = None
        if tensorboard is not None and self.rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UsageError("autoshard.Telemetry: tensorboard= needs the tensorboard package; pip install tensorboard, "
                                 "or pass tensorboard=None and read the JSON-lines file.") from None
            self.writer = SummaryWriter(tensorboard)
        if self.path is not None and self.rank == 0:
            with open(self.path, "w") as f:
                f.write(json.dumps({"run": {"world_size": self.world, "parameters": self.parameters, "every": every,
                                            "price_per_hour": self.price, "power_w": self.power,
                                            "prediction": self.prediction}}) + "\n")

    @contextmanager
    def step(self, tokens: int = 0) -> Iterator[None]:
        """Measure one training step (forward, backward, optimizer) of this rank's ``tokens``."""
        if timed_waits.recorder is not None:
            raise UsageError("autoshard.Telemetry: step() inside another step(); measure one step at a time.")
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        timed_waits.recorder = recorder = timed_waits.Recorder(cuda)
        start = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - start
            timed_waits.recorder = None
        for kind, before, after in recorder.events:
            recorder.wait[kind] += before.elapsed_time(after) / 1e3
        self.waits_seen = recorder.waits
        self.pending.append([elapsed, *(recorder.wait[k] for k in KINDS), *(recorder.bytes[k] for k in KINDS),
                             _peak_bytes(self.device), tokens])
        self.steps += 1
        if self.steps % self.every == 0:
            self._exchange()

    def _exchange(self) -> None:
        """Every rank's pending records to every rank (a collective), written by rank 0."""
        if not self.pending:
            return
        # [steps, fields] on the default group's device (NCCL: the GPU)
        mine = torch.tensor(self.pending, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        if self.world > 1:
            every = torch.empty((self.world * mine.shape[0], mine.shape[1]), dtype=mine.dtype, device=mine.device)
            all_gather_single(every, mine)
            every = every.view(self.world, *mine.shape).cpu()  # [ranks, steps, fields]
        else:
            every = mine[None].cpu()
        first = self.steps - len(self.pending)
        self.pending = []
        window = []
        for i in range(every.shape[1]):
            row = {"step": first + i, "ranks": [dict(zip(FIELDS, every[r, i].tolist())) for r in range(self.world)]}
            self.rows.append(row)
            window.append(row)
            if self.rank == 0:
                self._write(row)
        if self.sizes is not None:
            self._adapt(window)

    def _adapt(self, window: list[dict[str, Any]]) -> None:
        """The next split, decided alike on every rank from the window every rank holds."""
        busy = [statistics.median(busy_s(row["ranks"][r]) for row in window) for r in range(self.world)]
        new = adaptive_shares.next_split(self.sizes, busy, damping=self.damping, min_change=self.min_change, jump=self.jump)
        if new is None:
            return
        self.sizes = new
        set_batch_shares(self.model, new)  # a graph input: no recompile
        if self.rank == 0 and self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"shares": new, "from_step": self.steps}) + "\n")

    def _write(self, row: dict[str, Any]) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for rank, fields in enumerate(row["ranks"]):
                for name, value in fields.items():
                    self.writer.add_scalar(f"rank{rank}/{name}", value, row["step"])
            for name, value in kpis([row], self.parameters, self.price, self.power).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):  # the scalars; not lists, dicts, None
                    self.writer.add_scalar(f"kpi/{name}", value, row["step"])

    def summary(self) -> dict[str, Any]:
        """The KPIs over every step exchanged so far (call ``flush`` first for the latest)."""
        return kpis(self.rows, self.parameters, self.price, self.power, self.prediction)

    def flush(self) -> None:
        """Exchange and write what is pending now (a collective: every rank calls it)."""
        self._exchange()

    def close(self) -> dict[str, Any]:
        """Flush, close the writers and return :meth:`summary` (a collective)."""
        self._exchange()
        if self.writer is not None:
            self.writer.close()
        return self.summary()


def _per_rank(value: float | list[float] | None, world: int, name: str) -> list[float] | None:
    if value is None:
        return None
    values = [value] * world if isinstance(value, (int, float)) and not isinstance(value, bool) else list(value)
    if len(values) != world or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in values):
        raise UsageError(f"autoshard.Telemetry: {name} must be a number >= 0 or one per rank ({world}), got {value!r}.")
    return [float(v) for v in values]


def _prediction(given: Any) -> dict[str, Any] | None:
    if given is None or isinstance(given, dict):
        return given
    m = given.metrics  # an autoshard.Report (explain): what it predicted for one rank's step
    return {"step_s": m["step_time"], "comm_s": m["comm_time"], "exposed_comm_s": m["exposed_comm"],
            "overlap": m["overlap_ratio"], "peak_bytes": m["peak_bytes"], "comm_bytes": m["comm_bytes"]}


def _waits(fields: dict[str, float]) -> float:
    return sum(fields[f"wait_{k}_s"] for k in KINDS)


def busy_s(fields: dict[str, float]) -> float:
    """A rank's step less its waits in collectives: the time it computed."""
    return fields["step_s"] - _waits(fields)


def kpis(rows: list[dict[str, Any]], parameters: int, price: list[float] | None = None, power: list[float] | None = None,
         prediction: dict[str, float] | None = None) -> dict[str, Any]:
    """The seed's KPIs from exchanged records (medians over steps, per rank then across them):

    step_s (the slowest rank's median step), tokens_per_s (all ranks' tokens over that step),
    gb_per_billion_parameters (the largest rank's peak GB per billion parameters),
    exposed_comm_fraction (waits over the step, mean over ranks), busy_fraction per rank and its
    variance across ranks (utilisation variance: 0 when balanced), the slowest and the most
    waiting rank, bytes per kind per step (rank 0), tokens_per_dollar (given prices) and
    joules_per_step (given power), and the prediction given, beside; with a predicted
    communication time, the measured overlap: 1 - (mean measured wait / predicted comm time).
    """
    if not rows:
        return {}
    world = len(rows[0]["ranks"])
    per_rank = [{name: statistics.median(row["ranks"][r][name] for row in rows) for name in FIELDS} for r in range(world)]
    step = max(r["step_s"] for r in per_rank)
    waits = [_waits(r) for r in per_rank]
    busy = [max(busy_s(r), 0.0) / r["step_s"] if r["step_s"] else 0.0 for r in per_rank]
    mean_busy = sum(busy) / world
    tokens = sum(r["tokens"] for r in per_rank)
    out: dict[str, Any] = {
        "steps": len(rows), "step_s": step, "tokens_per_s": tokens / step if step else 0.0,
        "gb_per_billion_parameters": max(r["peak_bytes"] for r in per_rank) / 1e9 / (parameters / 1e9) if parameters else None,
        "exposed_comm_fraction": sum(w / r["step_s"] for w, r in zip(waits, per_rank) if r["step_s"]) / world,
        "busy_fraction": busy, "busy_variance": sum((b - mean_busy) ** 2 for b in busy) / world,
        "slowest_rank": max(range(world), key=lambda r: per_rank[r]["step_s"] - waits[r]),
        "most_waiting_rank": max(range(world), key=lambda r: waits[r]),
        "wait_s": waits, "bytes_per_step": {k: per_rank[0][f"bytes_{k}"] for k in KINDS},
        # State shares stay as planned; this says when the ranks' memory is not balanced.
        "peak_bytes": [r["peak_bytes"] for r in per_rank],
        "memory_imbalance": max(r["peak_bytes"] for r in per_rank) / max(min(r["peak_bytes"] for r in per_rank), 1),
        "tokens_per_dollar": None, "joules_per_step": None, "prediction": prediction,
    }
    if price is not None and sum(price) > 0 and step:
        out["tokens_per_dollar"] = out["tokens_per_s"] * 3600 / sum(price)
    if power is not None:
        out["joules_per_step"] = sum(power) * step
    if prediction and prediction.get("comm_s"):
        out["overlap_measured"] = max(0.0, 1.0 - sum(waits) / world / prediction["comm_s"])
    return out
