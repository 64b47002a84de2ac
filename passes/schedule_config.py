"""What the scheduling passes read of the device: one object, built once from the profile.

:class:`ProfileFigures` declares the device profile's figures that the step model, the
scheduler, the bucket planner and the simulator read; ``DeviceProfile``
(``autoshard/cost/profiles.py``) extends it, so a figure declared here is the profile's
(its JSON files, ``calibrate``) and reaches every consumer as ``config.figures.<name>``.
:class:`ScheduleConfig` holds the figures with what the cost model builds from the profile
(``autoshard/cost/cost_model.py``'s ``schedule_config``): the estimators, the workspace and
what the graph's collectives hold. It is passed whole; a new figure is its declaration here
and its reader.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import fx

from .graph_utils import collective_kind, is_exchange

Workspace = Callable[[fx.Node], int]  # bytes a collective holds besides its input and output, issue to wait


def no_workspace(node: fx.Node) -> int:
    return 0


def never(node: fx.Node) -> bool:
    return False


@dataclass(frozen=True, kw_only=True)
class ProfileFigures:
    """The device profile's figures the step model and the scheduler read.

    comm_overlap: the share of a collective's time during which compute keeps full speed:
        1 where collectives run on their own engines (GPUs), lower where they take cycles
        from compute (CPU ranks sharing cores with gloo's threads).
    comm_issue_cost: seconds of compute each collective costs its caller besides that share
        (issuing it; on CPU ranks gloo's thread waking and polling on the compute's cores), so
        one more collective is never free while it hides: what a tiny all-gather hidden behind
        matmuls adds to their time, less ``(1 - comm_overlap)`` of its latency. 0 on GPUs.
    fsdp2_blocking: whether FSDP2 eager's collectives block their caller here (gloo on CPU:
        no side streams): its forward then gathers at use, its backward prefetch only gathers
        early, each reduce-scatter ends before the next bucket, and its buffers are freed
        when the call returns. Elsewhere (GPUs) it prefetches the next bucket and keeps one
        reduce-scatter in flight. The default schedule never plans above that peak.
    """

    comm_overlap: float = 1.0
    comm_issue_cost: float = 0.0
    fsdp2_blocking: bool = False

    def fsdp2_policy(self, side: str) -> tuple[int, int]:
        """FSDP2 eager's (prefetch distance, reductions in flight) on ``side`` of the step."""
        if self.fsdp2_blocking:
            return (0 if side == "forward" else 1), 0
        return 1, 1

    def caller_cost(self, duration: float) -> float:
        """Compute time a collective of ``duration`` seconds takes from its caller while it runs
        (the simulator and the planner price it alike): at most the collective's own time."""
        return min(duration, (1 - self.comm_overlap) * duration + self.comm_issue_cost)


@dataclass(frozen=True)
class CollectiveMemory:
    """What the memory model assumes of a graph's collectives, by kind (``"all_gather"``, ...)."""

    late_release: tuple[str, ...] = ()  # buffers may outlive their waits (DeviceProfile.comm_release_late)
    output_at_wait: tuple[str, ...] = ()  # the result is made at the wait (passes/gloo.py)
    input_copied: tuple[str, ...] = ()  # the input is free from the issue on (DeviceProfile.comm_input_copied)

    def copies_input(self, node: fx.Node) -> bool:
        """Whether ``node``'s backend copies its input at the issue (not an all-to-all run as a
        reduce-scatter, passes/gloo.py: it sends from its input)."""
        return collective_kind(node) in self.input_copied and not is_exchange(node)


@dataclass(frozen=True)
class ScheduleConfig:
    """How one graph is priced: ``compute_time(node)``, ``comm_time(collective, nbytes=None)``
    (``nbytes``: its time at another size), in seconds; the profile's :class:`ProfileFigures`
    (the profile itself, as the cost model builds it); a collective's in-flight extra bytes;
    what its collectives' buffers hold, and until when."""

    compute_time: Callable[[fx.Node], float]
    comm_time: Callable[..., float]
    figures: ProfileFigures = ProfileFigures()
    workspace: Workspace = no_workspace
    collectives: CollectiveMemory = CollectiveMemory()
