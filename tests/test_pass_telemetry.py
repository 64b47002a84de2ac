"""passes/telemetry.py alone: a timed wait in front of each collective's wait (see pass_graphs.py
for the graphs and the notation; ``tw(kind)`` is ``autoshard::timed_wait``)."""
from __future__ import annotations

from torch import fx

from autoshard.cost.cost_model import collective_of
from autoshard.passes.graph_utils import is_wait
from autoshard.passes.telemetry import TIMED_WAIT, time_waits

from pass_graphs import bucketed, label


def _events(gm: fx.GraphModule) -> list[str]:
    return [f"tw({n.args[1]})" if n.target is TIMED_WAIT else label(n) for n in gm.graph.nodes
            if n.target is TIMED_WAIT or label(n) is not None]


def test_each_wait_gets_one_timed_wait_in_front_of_it_on_the_same_tensor(drawing):
    """Nothing else moves; the timed wait names the collective's kind and full-buffer bytes.

    before: ag(0.w+0.b) wait(0.w+0.b) mm ag(1.w+1.b) wait(1.w+1.b) mm
            ag(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    after:  ag(0.w+0.b) tw(all_gather) wait(0.w+0.b) mm ag(1.w+1.b) tw(all_gather) wait(1.w+1.b) mm
            ag(2.w+2.b+norm.w+norm.b) tw(all_gather) wait(2.w+2.b+norm.w+norm.b) mm ln
    """
    forward = bucketed("forward")
    assert _events(forward) == drawing("before")
    time_waits(forward, collective_of)
    assert _events(forward) == drawing("after")
    for wait in [n for n in forward.graph.nodes if is_wait(n)]:
        timed = wait.prev
        assert timed.target is TIMED_WAIT and timed.args[0] is wait.args[0]
        assert timed.args[2] == collective_of(wait.args[0]).nbytes > 0


def test_the_backwards_reductions_are_timed_as_reduce_scatters() -> None:
    backward = time_waits(bucketed("backward"), collective_of)
    waits = [n for n in backward.graph.nodes if is_wait(n)]
    timed = [n for n in backward.graph.nodes if n.target is TIMED_WAIT]
    assert len(timed) == len(waits) > 0
    assert {n.args[1] for n in timed} >= {"reduce_scatter"}
