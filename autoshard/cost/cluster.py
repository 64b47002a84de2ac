"""A mixed cluster as the planner and the mixed-cluster simulator read it: groups of identical
nodes, each with its device profile, memory per rank and price, laid out in order (the first
group's nodes hold ranks 0.., the next group's follow)::

    cluster = Cluster((NodeGroup(4, "h100", memory_gb=80, price_per_hour=4.0),
                       NodeGroup(4, "a100", memory_gb=40, price_per_hour=1.8)))
    plan = autoshard.plan(make_model, tokens, tokens, cluster=cluster)

A node group is one *rank type*: its ranks run at its profile's speed and hold at most its
memory. Every check of a cluster is in :meth:`Cluster.__post_init__`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from autoshard.cost.cost_model import get_profile
from autoshard.cost.profiles import DeviceProfile, Link
from autoshard.runtime.errors import UsageError


@dataclass(frozen=True)
class NodeGroup:
    """``count`` nodes of ``ranks_per_node`` ranks each on ``profile`` (a name such as
    ``"h100"``, a ``.json`` from ``autoshard calibrate`` run on that node type, or a
    :class:`DeviceProfile`); ``memory_gb``: what one rank may hold, GiB (None: the plan's
    ``memory_budget_gb``); ``price_per_hour``: dollars per device (rank) and hour (None: unknown)."""

    count: int
    profile: str | DeviceProfile
    ranks_per_node: int = 8
    memory_gb: float | None = None
    price_per_hour: float | None = None

    @property
    def ranks(self) -> int:
        return self.count * self.ranks_per_node

    @property
    def device(self) -> DeviceProfile:
        """The profile, with this group's ranks per node."""
        return dataclasses.replace(get_profile(self.profile), ranks_per_node=self.ranks_per_node)

    @property
    def name(self) -> str:
        return self.device.name


@dataclass(frozen=True)
class Cluster:
    """Node groups in rank order, and the link between nodes (None: each group's own profile's
    between its own nodes; between groups, the slower of theirs: the slowest hop paces a ring)."""

    nodes: tuple[NodeGroup, ...]
    inter: Link | None = None

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes) if isinstance(self.nodes, (list, tuple)) else None
        if not nodes or not all(isinstance(g, NodeGroup) for g in nodes):
            raise UsageError(f"autoshard.Cluster: nodes must be a non-empty sequence of NodeGroup, got {self.nodes!r}; e.g. "
                             "Cluster((NodeGroup(4, 'h100', memory_gb=80), NodeGroup(4, 'a100', memory_gb=40))).")
        object.__setattr__(self, "nodes", nodes)
        for i, g in enumerate(nodes):
            for field_name in ("count", "ranks_per_node"):
                value = getattr(g, field_name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise UsageError(f"autoshard.Cluster: node group {i}: {field_name} must be a positive int, got {value!r}.")
            for field_name in ("memory_gb", "price_per_hour"):
                value = getattr(g, field_name)
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                    raise UsageError(f"autoshard.Cluster: node group {i}: {field_name} must be a positive number or None, "
                                     f"got {value!r}.")
            try:
                g.device
            except ValueError as e:  # get_profile's unknown name or unreadable file
                raise UsageError(f"autoshard.Cluster: node group {i}: {e}") from None
        if len({g.ranks_per_node for g in nodes}) > 1:
            raise UsageError("autoshard.Cluster: every node group must have the same ranks_per_node (the plan's meshes tile "
                             f"nodes evenly), got {[g.ranks_per_node for g in nodes]}; split a node type's devices into "
                             "equal nodes.")
        prices = [g.price_per_hour is None for g in nodes]
        if any(prices) and not all(prices):
            raise UsageError("autoshard.Cluster: give price_per_hour for every node group or for none (throughput per dollar "
                             "needs every device's price).")
        if self.inter is not None and not isinstance(self.inter, Link):
            raise UsageError(f"autoshard.Cluster: inter must be a Link or None, got {type(self.inter).__name__}.")

    @property
    def world_size(self) -> int:
        return sum(g.ranks for g in self.nodes)

    @property
    def ranks_per_node(self) -> int:
        return self.nodes[0].ranks_per_node

    @property
    def homogeneous(self) -> bool:
        """One profile and one memory size everywhere (the plan is then the single-type plan of that profile and size)."""
        return len({(g.device, g.memory_gb) for g in self.nodes}) == 1 and self.inter is None

    @property
    def label(self) -> str:
        return " + ".join(f"{g.ranks}x {g.name}" for g in self.nodes)

    def first_ranks(self) -> list[int]:
        """The first global rank of each node group."""
        starts, rank = [], 0
        for g in self.nodes:
            starts.append(rank)
            rank += g.ranks
        return starts

    def slowest(self) -> int:
        """The node group whose devices compute slowest (the lowest float32 peak, then memory bandwidth)."""
        return min(range(len(self.nodes)), key=lambda i: (self.nodes[i].device.peak_flops["float32"],
                                                         self.nodes[i].device.mem_bandwidth, i))

    def smallest_memory_gb(self, default: float | None) -> float | None:
        """The least memory per rank of any group (``default`` for a group that gives none)."""
        sizes = [default if g.memory_gb is None else g.memory_gb for g in self.nodes]
        return None if any(s is None for s in sizes) else min(sizes)

    def pooled_memory_gb(self, default: float | None) -> float | None:
        """The memory per rank averaged over the ranks, where every group gives its own and they
        differ (state shares spread the state by memory, autoshard.tools.plan.shares); else
        :meth:`smallest_memory_gb`."""
        sizes = [g.memory_gb for g in self.nodes]
        if any(s is None for s in sizes) or len(set(sizes)) == 1:
            return self.smallest_memory_gb(default)
        return sum(g.memory_gb * g.ranks for g in self.nodes) / self.world_size

    def as_slowest(self) -> DeviceProfile:
        """Every rank as slow as the slowest group's (the profile the single-type plan uses)."""
        device = self.nodes[self.slowest()].device
        return device if self.inter is None else dataclasses.replace(device, inter=self.inter)

    def link_profile(self, groups: list[int]) -> DeviceProfile:
        """The profile a collective spanning ``groups`` (node group indices) is priced on: the
        slowest intra-node and inter-node link among them (the slowest hop paces a ring)."""
        devices = [self.nodes[i].device for i in groups]
        slowest = lambda links: min(links, key=lambda link: min(link.bandwidth.values()))  # noqa: E731
        inters = [d.inter for d in devices if d.inter is not None]
        inter = self.inter if self.inter is not None else (slowest(inters) if inters else None)
        return dataclasses.replace(devices[0], intra=slowest([d.intra for d in devices]), inter=inter)

    def to_dict(self) -> dict:
        """Plain JSON-able data; a profile given as a :class:`DeviceProfile` is kept whole."""
        def group(g: NodeGroup) -> dict:
            profile = g.profile if isinstance(g.profile, str) else json.loads(g.profile.to_json())
            return {**{f.name: getattr(g, f.name) for f in dataclasses.fields(g)}, "profile": profile}
        return {"nodes": [group(g) for g in self.nodes], "inter": None if self.inter is None else dataclasses.asdict(self.inter)}

    @staticmethod
    def from_dict(data: dict) -> Cluster:
        def group(g: dict) -> NodeGroup:
            profile = g["profile"] if isinstance(g["profile"], str) else DeviceProfile.from_json(json.dumps(g["profile"]))
            return NodeGroup(**{**g, "profile": profile})
        return Cluster(tuple(group(g) for g in data["nodes"]), Link(**data["inter"]) if data.get("inter") else None)
