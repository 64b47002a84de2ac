"""normalize_collectives: one wait per collective, and a collective nothing uses removed, on a
small traced graph (Stack's backward, with what the partitioner leaves drawn in) and in a case
that needs it end to end (a graph ending at a gathered parameter, as before a graph break)."""
from __future__ import annotations

import torch
from torch import fx, nn

import autoshard
from autoshard._compat import c10d
from autoshard.passes import normalize_collectives
from autoshard.passes.graph_utils import PARAMS, call

from fake_pg import captured_graphs, count, fake_world
from pass_graphs import WORLD, Stack, events, stage

aten = torch.ops.aten


def _unused_gather(gm: fx.GraphModule, shard: fx.Node, name: str) -> None:
    """What the partitioner leaves in a backward: pad -> gather -> wait -> slice, read by nobody."""
    graph = gm.graph
    with graph.inserting_after(shard):
        pad = call(graph, torch.ops.autoshard.pad_shard.default, shard, 2)
    with graph.inserting_after(pad):
        gather = call(graph, c10d.all_gather_into_tensor.default, pad, WORLD, "0")
        gather.meta[PARAMS] = (name,)
    with graph.inserting_after(gather):
        wait = call(graph, c10d.wait_tensor.default, gather)
    with graph.inserting_after(wait):
        call(graph, aten.slice.Tensor, wait, 0, 0, 8)


def test_a_gather_nothing_reads_is_dropped_with_its_copy_in(drawing):
    """Stack's backward with an extra gather of 0.w nobody reads (drawn first, its pad and
    slice not drawn); everything else stays in place.

    before:  ag(0.w) wait(0.w) ag(norm.w) wait(norm.w) ag(norm.b) wait(norm.b) ln_bw
             rs(norm.w) wait(norm.w) rs(norm.b) wait(norm.b) ag(2.w) wait(2.w) mm mm rs(2.b) wait(2.b)
             rs(2.w) wait(2.w) ag(1.w) wait(1.w) mm mm rs(1.b) wait(1.b) rs(1.w) wait(1.w) mm rs(0.b)
             wait(0.b) rs(0.w) wait(0.w)
    after:   ag(norm.w) wait(norm.w) ag(norm.b) wait(norm.b) ln_bw
             rs(norm.w) wait(norm.w) rs(norm.b) wait(norm.b) ag(2.w) wait(2.w) mm mm rs(2.b) wait(2.b)
             rs(2.w) wait(2.w) ag(1.w) wait(1.w) mm mm rs(1.b) wait(1.b) rs(1.w) wait(1.w) mm rs(0.b)
             wait(0.b) rs(0.w) wait(0.w)
    """
    gm = stage(Stack, "backward")
    kept = events(gm)
    shard = next(n for n in gm.graph.nodes if n.op == "placeholder")
    _unused_gather(gm, shard, "layers.0.weight")
    assert events(gm) == drawing("before")
    nodes = len(gm.graph.nodes)
    normalize_collectives(gm)
    assert events(gm) == drawing("after") == kept
    assert len(gm.graph.nodes) == nodes - 4  # pad, gather, wait, slice


def test_a_collective_with_two_waits_keeps_the_first(drawing):
    """The partitioner's CSE made one reduce-scatter of two equal gradients (two BatchNorm
    biases fed the same gradient, in a ResNet block): its two waits become the first, and what
    read the second reads the first (the add, drawn after them, here reads both).

    before:  ag(norm.w) wait(norm.w) ag(norm.b) wait(norm.b) ln_bw
             rs(norm.w) wait(norm.w) rs(norm.b) wait(norm.b) ag(2.w) wait(2.w) mm mm rs(2.b) wait(2.b)
             rs(2.w) wait(2.w) ag(1.w) wait(1.w) mm mm rs(1.b) wait(1.b) rs(1.w) wait(1.w) mm rs(0.b)
             wait(0.b) rs(0.w) wait(0.w) wait(0.w) add
    after:   ag(norm.w) wait(norm.w) ag(norm.b) wait(norm.b) ln_bw
             rs(norm.w) wait(norm.w) rs(norm.b) wait(norm.b) ag(2.w) wait(2.w) mm mm rs(2.b) wait(2.b)
             rs(2.w) wait(2.w) ag(1.w) wait(1.w) mm mm rs(1.b) wait(1.b) rs(1.w) wait(1.w) mm rs(0.b)
             wait(0.b) rs(0.w) wait(0.w) add
    """
    gm = stage(Stack, "backward")
    graph = gm.graph
    *_, first, output = graph.nodes
    reduce = first.args[0]
    with graph.inserting_before(output):
        second = call(graph, c10d.wait_tensor.default, reduce)
        add = call(graph, aten.add.Tensor, first, second)
    assert events(gm) == drawing("before")
    normalize_collectives(gm)
    assert events(gm) == drawing("after")
    assert add.args == (first, first) and [u for u in reduce.users] == [first]


def test_a_collective_whose_result_is_used_or_returned_stays():
    gm = stage(Stack, "backward")
    before = [n.format_node() for n in gm.graph.nodes]
    normalize_collectives(gm)
    assert [n.format_node() for n in gm.graph.nodes] == before


class ReturnsWeight(nn.Module):
    """A graph whose output is a gathered weight, as when Dynamo breaks the graph right after
    reading a parameter (transformers' Llama with its checkpointing switch: the embedding's
    weight). The partitioner recomputes the gather in the backward, where nothing reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)

    def forward(self) -> torch.Tensor:
        return self.emb.weight


def test_a_graph_ending_at_a_gathered_weight_compiles_with_no_gather_in_its_backward():
    with fake_world(WORLD), captured_graphs() as graphs:
        compiled = torch.compile(autoshard.shard(ReturnsWeight()), backend="autoshard", options={"compiler": "aot_eager"})
        compiled().sum().backward()
    (forward,), (backward,) = graphs["forward"], graphs["backward"]
    assert count(forward, "all_gather") == 1
    assert count(backward, "all_gather") == 0 and count(backward, "reduce_scatter") == 1  # the weight's gradient only
