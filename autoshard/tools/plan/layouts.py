"""The layouts ``autoshard.plan`` searches, and what each costs at least, read off the model's
parameters alone (no compile).

A layout (:class:`Candidate`) is a strategy on a mesh in a precision for the whole model, or,
for a mixed layout, a second strategy and mesh for some of its repeated blocks (sharded
first, as FSDP2 users call ``fully_shard`` per block). :class:`Bounds` prices a layout from
below: the bytes its collectives must move on their busiest stream (every parameter gathered
and every gradient reduced once per use, in one collective each: splitting only adds
latency), and the per-rank state no schedule avoids (shards, gradients and optimizer state).
The planner compiles a layout only when these bounds leave it a chance to be chosen.

A model with experts modules (:func:`autoshard.runtime.experts.is_experts`) whose expert
counts the world divides also gets each 1-D layout with its experts split over every rank
(``experts="parallel"``, the only degree built): the experts' bytes then leave the gathers and
reductions and stay 1/N per rank; the bound leaves out the all-to-alls, whose sizes follow the
tokens (a lower bound stays one).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autoshard.cost.cost_model import DeviceProfile, collective_time
from autoshard.runtime.compression import Compression
from autoshard.runtime.experts import is_experts
from autoshard.runtime.quantize import SCALE_BYTES

# bf16: gathered and computed in bfloat16, gradients reduced in float32. The int8 ones gather
# int8 with float32 scales (autoshard.Compression(gather="int8")) and compute in float32 or
# bfloat16: lossy, so tried only where a user lists them.
PRECISIONS = ("fp32", "bf16", "int8", "bf16_int8")
INT8_BYTES = 1 + SCALE_BYTES / Compression().block  # per element on the wire, the scales included


@dataclass(frozen=True)
class Candidate:
    """One layout of the world: a strategy, the mesh it shards over (``(world,)``, or
    ``(replicas, shard_size)`` for ``"hybrid"``) and the precision of gathers and compute;
    for a mixed layout, the repeated ``blocks`` laid out as ``block_strategy`` on
    ``block_mesh_shape`` instead (the rest of the model as ``strategy``).
    ``all_reduce_blocks``: the backend option compiled with (blocks per all-reduce bucket)."""

    strategy: str
    mesh_shape: tuple[int, ...]
    precision: str = "fp32"
    blocks: tuple[str, ...] = ()
    block_strategy: str = ""
    block_mesh_shape: tuple[int, ...] = ()
    experts: str = "gathered"  # "parallel": the experts modules split over every rank (shard's experts=)
    all_reduce_blocks: int = 1
    tensor_parallel: int = 1  # the tp degree; mesh_shape is then the data-parallel mesh (plan/tensor_parallel.py)

    def label(self, ranks_per_node: int) -> str:
        name = _layout_label(self.strategy, self.mesh_shape, ranks_per_node)
        if self.blocks:
            span = self.blocks[0] if len(self.blocks) == 1 else f"{self.blocks[0]}..{self.blocks[-1]}"
            name += f"; {_layout_label(self.block_strategy, self.block_mesh_shape, ranks_per_node)} for {span}"
        name += ", experts parallel" if self.experts == "parallel" else ""
        name += f", all-reduce per {self.all_reduce_blocks} blocks" if self.all_reduce_blocks > 1 else ""
        name += f", tp {self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return name if self.precision == "fp32" else f"{name}, {self.precision}"

    @property
    def whole(self) -> bool:
        """One strategy for the whole model."""
        return not self.blocks

    def mixed_layout(self, blocks: tuple[str, ...], fast: Candidate) -> Candidate:
        """This layout with ``blocks`` laid out as ``fast`` is."""
        return Candidate(self.strategy, self.mesh_shape, self.precision, tuple(blocks), fast.strategy, fast.mesh_shape, self.experts)


def _layout_label(strategy: str, mesh_shape: tuple[int, ...], ranks_per_node: int) -> str:
    if strategy != "hybrid":
        return strategy
    nodes = mesh_shape[1] / ranks_per_node
    return f"hybrid, shard over {nodes:g} node{'s' if nodes != 1 else ''}"


def candidates(world_size: int, ranks_per_node: int, precisions: tuple[str, ...] = ("fp32",),
               expert_parallel: bool = False) -> list[Candidate]:
    """The whole-model layouts searched, in the order ties are broken: full shard first, each
    layout in every precision of ``precisions`` (replicate not in the int8 ones); with ``expert_parallel``, each 1-D layout
    also with its experts split over every rank (after its gathered twin: a tie keeps the gathered one)."""
    layouts = [("full", (world_size,)), ("grad_op", (world_size,))]
    shard_size = ranks_per_node
    while shard_size < world_size:
        if world_size % shard_size == 0:
            layouts.append(("hybrid", (world_size // shard_size, shard_size)))
        shard_size *= 2
    layouts.append(("replicate", (world_size,)))
    experts = lambda shape: ("gathered", "parallel") if expert_parallel and len(shape) == 1 else ("gathered",)  # noqa: E731
    return [Candidate(strategy, shape, precision, experts=e) for strategy, shape in layouts for e in experts(shape)
            for precision in precisions if not (strategy == "replicate" and precision.endswith("int8"))]  # replicate gathers nothing


def repeated_blocks(model: nn.Module) -> tuple[str, ...]:
    """The names of the model's repeated blocks: the entries of its largest (by parameters)
    ``nn.ModuleList`` or ``nn.Sequential`` of two or more modules of one class, each owning
    parameters (``blocks.0``, ``blocks.1``, ... in a GPT; ``model.layers.*`` in Llama)."""
    best: tuple[int, tuple[str, ...]] = (0, ())
    for prefix, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module.named_children())
        if len({type(child) for _, child in children}) != 1:
            continue
        size = sum(p.numel() for _, child in children for p in child.parameters())
        if size and all(any(True for _ in child.parameters()) for _, child in children) and size > best[0]:
            best = (size, tuple(f"{prefix}.{name}" if prefix else name for name, _ in children))
    return best[1]


@dataclass(frozen=True)
class Params:
    """What the bounds need of a model: the bytes of its distinct splittable (dim > 0)
    parameters, in their own dtypes, and of each repeated block's."""

    nbytes: int
    trainable_nbytes: int
    element_size: float  # bytes per element, on average
    blocks: dict[str, tuple[int, int]]  # repeated block -> (nbytes, trainable nbytes)
    experts: tuple[int, int] = (0, 0)  # the experts modules' (nbytes, trainable nbytes)
    expert_counts: tuple[int, ...] = ()  # experts in each experts module

    def expert_parallel(self, world_size: int) -> bool:
        """Whether ``experts="parallel"`` can split every experts module over ``world_size`` ranks."""
        return bool(self.expert_counts) and world_size > 1 and all(e % world_size == 0 for e in self.expert_counts)

    @staticmethod
    def of(model: nn.Module) -> Params:
        def sizes(module: nn.Module) -> tuple[int, int, int]:
            split = [p for p in module.parameters() if p.dim() > 0]
            nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
            return nbytes(split), nbytes([p for p in split if p.requires_grad]), sum(p.numel() for p in split)

        nbytes, trainable, numel = sizes(model)
        blocks = {name: sizes(model.get_submodule(name))[:2] for name in repeated_blocks(model)}
        found = [m for m in model.modules() if is_experts(m)]
        experts = [sizes(m)[:2] for m in found]  # is_experts: their own parameters only, no children
        counts = tuple(next(iter(m.parameters())).shape[0] for m in found)
        return Params(nbytes, trainable, nbytes / max(numel, 1), blocks, (sum(e[0] for e in experts), sum(e[1] for e in experts)),
                      counts)


def _shard_size(strategy: str, mesh_shape: tuple[int, ...]) -> int:
    return 1 if strategy == "replicate" else mesh_shape[-1]


@dataclass(frozen=True)
class Bounds:
    """Lower bounds of a layout's predicted step and peak, from :class:`Params` alone.
    Assumes every parameter is used by the forward (an unused one moves no bytes)."""

    params: Params
    profile: DeviceProfile
    optimizer_states: int

    def _parts(self, c: Candidate) -> list[tuple[str, tuple[int, ...], float, float]]:
        """(strategy, mesh shape, bytes, trainable bytes) of each part of the model."""
        p = self.params
        blocks = [p.blocks[name] for name in c.blocks]
        nbytes, trainable = sum(b[0] for b in blocks), sum(b[1] for b in blocks)
        parts = [(c.strategy, c.mesh_shape, p.nbytes - nbytes, p.trainable_nbytes - trainable)]
        if c.experts == "parallel":  # a whole-model layout only: the experts' bytes leave the root's part
            e, et = p.experts
            parts = [(c.strategy, c.mesh_shape, p.nbytes - e, p.trainable_nbytes - et), ("experts", c.mesh_shape, e, et)]
        return parts + ([(c.block_strategy, c.block_mesh_shape, nbytes, trainable)] if blocks else [])

    def memory(self, c: Candidate) -> float:
        """Per rank, the larger of: shards, gradients and optimizer state (alive at the end of
        every backward), and shards, optimizer state and what ``"grad_op"`` keeps gathered
        from forward to backward (alive at the end of every forward)."""
        parts, states = self._parts(c), self.optimizer_states
        kept = sum((1 + states) * n / _shard_size(s, shape) for s, shape, n, _ in parts)
        grads = sum(t / _shard_size(s, shape) for s, shape, _, t in parts)
        gathered = sum(self._computed_bytes(n, c.precision) for s, _, n, _ in parts if s == "grad_op")
        return kept + max(grads, gathered)

    def _gather_bytes(self, nbytes: float, precision: str) -> float:
        """What a gather of ``nbytes`` of parameters sends in ``precision``."""
        if precision.endswith("int8"):
            return nbytes * INT8_BYTES / self.params.element_size
        return self._computed_bytes(nbytes, precision)

    def _computed_bytes(self, nbytes: float, precision: str) -> float:
        """What ``nbytes`` of parameters take gathered, in the dtype the model computes in."""
        return nbytes * 2 / self.params.element_size if precision.startswith("bf16") else nbytes  # bf16: 2 bytes per element

    def step(self, c: Candidate) -> float:
        """The busiest process group's collectives for one step on rank 0, each kind as one
        collective of all its bytes (the simulator runs a group's collectives one at a time)."""
        busy = [sum(collective_time(kind, nbytes, group, self.profile) for kind, nbytes in moves)
                for group, moves in self._collectives(c).items()]
        return max(busy, default=0.0)

    def link_bytes(self, c: Candidate) -> tuple[float, float]:
        """(within a node, across nodes): the bytes rank 0 sends per step in the layout's
        collectives (a ring sends (n-1)/n of a full buffer, twice for an all-reduce), by where
        its group lies; a group spanning nodes counts across, as its slowest hop paces it."""
        within = across = 0.0
        per_node = self.profile.ranks_per_node
        for group, moves in self._collectives(c).items():
            sent = sum((2 if kind == "all_reduce" else 1) * (len(group) - 1) / len(group) * nbytes for kind, nbytes in moves)
            if len({r // per_node for r in group}) > 1 and self.profile.inter is not None:
                across += sent
            else:
                within += sent
        return within, across

    def _collectives(self, c: Candidate) -> dict[tuple[int, ...], list[tuple[str, int]]]:
        """Rank 0's process groups and what each moves per step: (kind, full-buffer bytes),
        every parameter gathered once per forward and backward use and every gradient reduced once."""
        moves: dict[tuple[int, ...], list[tuple[str, int]]] = {}
        for strategy, shape, nbytes, trainable in self._parts(c):
            gather = int(self._gather_bytes(nbytes, c.precision))
            # bf16: reduced in float32
            reduce = int(trainable * 4 / self.params.element_size if c.precision.startswith("bf16") else trainable)
            world = shape[0] * (shape[1] if len(shape) > 1 else 1)
            if strategy == "experts":  # never gathered nor reduce-scattered; the all-to-alls are left out
                continue
            if strategy == "replicate":
                moves.setdefault(tuple(range(world)), []).append(("all_reduce", reduce))
                continue
            shard_group = moves.setdefault(tuple(range(shape[-1])), [])
            shard_group += [("all_gather", gather)] * (1 if strategy == "grad_op" else 2)  # full, hybrid: again in backward
            shard_group.append(("reduce_scatter", reduce))
            if strategy == "hybrid" and shape[0] > 1:  # then the reduced shards are averaged across the replicas
                moves.setdefault(tuple(range(0, world, shape[1])), []).append(("all_reduce", reduce // shape[1]))
        return moves
