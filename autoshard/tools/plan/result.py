"""What :func:`autoshard.plan` returns: the chosen layout (:class:`Plan`) and what each candidate
was predicted to cost (:class:`Outcome`), their summary table and their JSON form."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from autoshard.cost.cluster import Cluster
from autoshard.cost.mixed_cluster import TypeStep
from autoshard.cost.simulator import kwh_per_million_tokens
from autoshard.runtime.compression import Compression
from autoshard.runtime.errors import UsageError
from autoshard.runtime.layout import ShardLayout
from autoshard.runtime.mixed_precision import MixedPrecision
from autoshard.tools.plan.layouts import Candidate
from autoshard.tools.plan.mixed_summary import mixed_summary
from autoshard.tools.units import fmt_bytes, fmt_energy, fmt_time


@dataclass(frozen=True)
class Outcome:
    """A candidate as the cost model plays it; ``error`` when it does not compile (its budget)."""

    candidate: Candidate
    step_time: float | None = None  # seconds
    exposed_comm: float | None = None  # seconds
    peak_bytes: int | None = None  # per rank, optimizer state included
    error: str | None = None
    energy_j: float | None = None  # per rank and step (None where the profile has no power figures)
    link_bytes: tuple[float, float] | None = None  # sent per rank and step within a node, across nodes (Bounds.link_bytes)
    # On a mixed cluster: the step with the planned batch shares, and each rank type's share,
    # busy and waiting time and peak (step_time and peak_bytes above: every rank as the slowest).
    mixed_step: float | None = None
    types: tuple[TypeStep, ...] = ()

    @property
    def mixed_fits(self) -> bool:
        return self.mixed_step is not None and all(t.fits for t in self.types)


@dataclass(frozen=True)
class Plan:
    """The chosen layout (:attr:`layout`, the runtime's :class:`ShardLayout`) and what every
    candidate was predicted to cost."""

    strategy: str
    mesh_shape: tuple[int, ...]
    world_size: int
    ranks_per_node: int
    profile: str
    memory_budget_gb: float | None
    outcomes: tuple[Outcome, ...] = field(default=())
    precision: str = "fp32"
    blocks: tuple[str, ...] = ()  # sharded first, as block_strategy on block_mesh_shape
    block_strategy: str = ""
    block_mesh_shape: tuple[int, ...] = ()
    tokens_per_step: int | None = None  # over all ranks, when the first input holds token ids
    # Each global rank's fraction of the global batch (summing to 1); None: even. Set on a mixed cluster.
    batch_shares: tuple[float, ...] | None = None
    cluster: Cluster | None = None
    experts: str = "gathered"  # "parallel": the experts modules split over every rank (autoshard.shard's experts=)
    # Each global rank's share of the parameters, gradients and optimizer state (summing to 1);
    # None: even. Set on a mixed cluster where even shards do not fit a type's memory.
    state_shares: tuple[float, ...] | None = None
    # Blocks per all-reduce bucket, the backend option (chosen on a mixed cluster; 1: one per block).
    all_reduce_blocks: int = 1
    # The tensor-parallel degree (mesh_shape: the data-parallel mesh then), the global batch it
    # was planned for, and why that degree (autoshard/tools/plan/tensor_parallel.py).
    tensor_parallel: int = 1
    global_batch: int | None = None
    tensor_parallel_why: str = ""

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.strategy, self.mesh_shape, self.precision, self.blocks, self.block_strategy, self.block_mesh_shape,
                         self.experts, self.all_reduce_blocks, self.tensor_parallel)

    @property
    def compile_options(self) -> dict[str, Any]:
        """The backend options the plan was played with, beyond the defaults:
        ``torch.compile(model, backend="autoshard", options={**plan.compile_options, ...})``."""
        return {"all_reduce_blocks": self.all_reduce_blocks} if self.all_reduce_blocks > 1 else {}

    @property
    def chosen(self) -> Outcome:
        return next(o for o in self.outcomes if o.candidate == self.candidate)

    @property
    def layout(self) -> ShardLayout:
        """What ``autoshard.shard(model, plan=...)`` applies."""
        if self.tensor_parallel > 1:
            raise UsageError(f"autoshard.shard: plan= cannot apply a plan with tensor parallelism (tp {self.tensor_parallel}); apply it as "
                             f"init_device_mesh(..., ({self.mesh_shape[0]}, {self.tensor_parallel}), mesh_dim_names=('dp', 'tp')), "
                             "parallelize_module(model, mesh['tp'], tp_plan), autoshard.shard(model, mesh['dp'], "
                             "strategy=plan.strategy, mixed_precision=plan.mixed_precision).")
        return ShardLayout(self.strategy, tuple(self.mesh_shape), self.world_size, self.mixed_precision, tuple(self.blocks),
                           self.block_strategy, tuple(self.block_mesh_shape), self.experts, self.compression)

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        """What ``autoshard.shard`` takes for the plan's precision."""
        return _mixed_precision(self.precision)

    @property
    def compression(self) -> Compression | None:
        """What ``autoshard.shard`` takes for the plan's gathers (int8 only where ``precisions`` allowed it)."""
        return _compression(self.precision)

    def summary(self) -> str:
        return self._table() + ("" if self.cluster is None else "\n" + mixed_summary(self))

    def _table(self) -> str:
        budget = "none" if self.memory_budget_gb is None else f"{self.memory_budget_gb:g} GiB"
        names = [("* " if o.candidate == self.candidate else "  ") + o.candidate.label(self.ranks_per_node) for o in self.outcomes]
        width = max(len("candidate"), *map(len, names))
        lines = [f"plan for {self.world_size} ranks ({self.ranks_per_node} per node), profile {self.profile}, budget {budget}",
                 f"{'candidate':{width}s} {'mesh':>16s} {'step':>10s} {'exposed':>8s} {'peak per rank':>14s} {'sent in node':>12s} "
                 f"{'across nodes':>12s} {'energy/step':>12s}"
                 + (f" {'kWh/Mtok':>9s}" if self.tokens_per_step else "")]
        for name, o in zip(names, self.outcomes):
            c = o.candidate
            mesh = str(c.mesh_shape) if c.whole else f"{c.mesh_shape}+{c.block_mesh_shape}"
            if o.error is not None:
                lines.append(f"{name:{width}s} {mesh:>16s}   {o.error}")
                continue
            over = "" if o.peak_bytes <= _limit_bytes(self.memory_budget_gb) else "  over budget"
            energy = "" if o.energy_j is None else fmt_energy(o.energy_j * self.world_size)  # over all ranks
            kwh = (f" {kwh_per_million_tokens(o.energy_j, self.world_size, self.tokens_per_step):9.3g}"
                   if self.tokens_per_step and o.energy_j is not None else "")
            within, across = (fmt_bytes(b) for b in o.link_bytes) if o.link_bytes else ("", "")
            lines.append(f"{name:{width}s} {mesh:>16s} {fmt_time(o.step_time):>10s} {o.exposed_comm / o.step_time:8.1%} "
                         f"{fmt_bytes(o.peak_bytes):>14s} {within:>12s} {across:>12s} {energy:>12s}{kwh}{over}")
        if self.experts == "parallel":
            lines.append(f"experts modules: split over all {self.world_size} ranks (experts='parallel'), tokens sent to them by all-to-all")
        if self.compression is not None:
            lines.append(self._compression_line())
        if self.all_reduce_blocks > 1:
            lines.append(f"all-reduces: one per {self.all_reduce_blocks} blocks (backend option all_reduce_blocks; "
                         "torch.compile(..., options=plan.compile_options))")
        if self.tensor_parallel_why:
            lines.append(f"tensor parallel: {self.tensor_parallel_why}")
        if not self.candidate.whole:
            lines.append(f"{len(self.blocks)} blocks ({', '.join(self.blocks[:3])}{', ...' if len(self.blocks) > 3 else ''}): "
                         f"{self.block_strategy} on {self.block_mesh_shape}; the rest: {self.strategy} on {self.mesh_shape}")
        return "\n".join(lines)

    def _compression_line(self) -> str:
        """What the chosen int8 gathers send against the same layout's uncompressed twin, where it was compiled."""
        base = self.precision.removesuffix("_int8").replace("int8", "fp32")  # int8 -> fp32, bf16_int8 -> bf16
        twin = next((o for o in self.outcomes if o.candidate == replace(self.candidate, precision=base) and o.link_bytes), None)
        line = f"gathers: int8 with a float32 scale per {self.compression.block} elements (lossy: allowed by precisions)"
        if not self.chosen.link_bytes:
            return line
        sent = sum(self.chosen.link_bytes)
        if twin is None:
            return line + f"; rank 0 sends {fmt_bytes(sent)} per step (the {base} layout was not compiled: its bounds lost)"
        uncompressed = sum(twin.link_bytes)
        return line + (f"; rank 0 sends {fmt_bytes(sent)} per step where the {base} layout sends {fmt_bytes(uncompressed)} "
                       f"({sent / uncompressed:.2f}x)")

    def to_json(self) -> str:
        data = asdict(self)
        data["cluster"] = None if self.cluster is None else self.cluster.to_dict()
        return json.dumps(data, indent=2)

    @staticmethod
    def from_json(text: str) -> Plan:
        data = json.loads(text)
        outcomes = tuple(Outcome(**{**o, "candidate": _candidate(o["candidate"]),
                                    "link_bytes": tuple(o["link_bytes"]) if o.get("link_bytes") else None,
                                    "types": tuple(TypeStep(**t) for t in o.get("types", ()))})
                         for o in data.pop("outcomes"))
        cluster = Cluster.from_dict(data["cluster"]) if data.get("cluster") else None
        shares = tuple(data["batch_shares"]) if data.get("batch_shares") else None
        state = tuple(data["state_shares"]) if data.get("state_shares") else None
        return Plan(**{**data, **_tuples(data), "outcomes": outcomes, "cluster": cluster, "batch_shares": shares,
                       "state_shares": state})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def load(path: str | Path) -> Plan:
        return Plan.from_json(Path(path).read_text())


_TUPLES = ("mesh_shape", "blocks", "block_mesh_shape")  # JSON keeps them as lists


def _tuples(data: dict) -> dict:
    return {key: tuple(data[key]) for key in _TUPLES if key in data}


def _candidate(data: dict) -> Candidate:
    return Candidate(**{**data, **_tuples(data)})


def _limit_bytes(memory_budget_gb: float | None) -> float:
    return float("inf") if memory_budget_gb is None else memory_budget_gb * 2**30


def _mixed_precision(precision: str) -> MixedPrecision | None:
    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision.startswith("bf16") else None


def _compression(precision: str) -> Compression | None:
    return Compression(gather="int8") if precision.endswith("int8") else None
