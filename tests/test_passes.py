"""The rewriting passes alone: merge_shared_parameters, lower_annotations, bucket_collectives.

Each test takes the stage a pass consumes (recorded from one compile with schedule "none",
so no pass beyond lowering has run; see pass_graphs.py for the graphs and the notation), runs
only that pass on a copy, and compares the sequence of communication and compute nodes with
the one its docstring draws.
"""
from __future__ import annotations

import pytest
import torch
from torch import fx

from autoshard._compat import c10d, recompute_region
from autoshard.passes import bucket_collectives, lower_annotations, merge_shared_parameters
from autoshard.passes.graph_utils import COPY_IN, COPY_OUT, GATHERED, PARAMS, arg, collective_kind, is_op, nbytes, val
from autoshard.passes.step_model import Storages

from pass_graphs import WORLD, Stack, Tied, events, gathers, label, policies, stage

# merge_shared_parameters (joint graph, before lowering) ----------------------------------


def test_merge_shared_gathers_a_tied_weight_once_and_reduces_the_summed_gradient_once(drawing):
    """inp.weight and out.weight are one shard: two annotations become one each way. (Read
    per use: read as ghosts, Dynamo already makes one input of the shared ghost.)

    before:  un(inp.w) mm un(out.w) mm mm mm rg(out.w) mm rg(inp.w) add
    after:   un(inp.w) mm mm mm mm mm add rg(out.w)
    """
    joint = stage(Tied, "joint", per_use=True)
    assert events(joint) == drawing("before")
    merge_shared_parameters(joint)
    assert events(joint) == drawing("after")
    (unshard,) = [n for n in joint.graph.nodes if is_op(n, torch.ops.autoshard.unshard)]
    (reduce,) = [n for n in joint.graph.nodes if is_op(n, torch.ops.autoshard.reduce_grad)]
    # The kept gather now feeds both matmuls; the reduce takes the sum of both uses' gradients.
    assert len([u for u in unshard.users if u.target is torch.ops.aten.t.default]) == 2
    assert arg(reduce, "grad").target is torch.ops.aten.add.Tensor
    assert arg(reduce, "shard_rows") == 8 // WORLD


# lower_annotations (joint graph) ----------------------------------------------------------


def test_lower_turns_annotations_into_collectives_and_waits(drawing):
    """Each unshard becomes a gather and its wait, each reduce_grad a reduce-scatter and its
    wait, in place; with ``reshard_after_forward=True`` every gather is tagged to be recomputed
    (gathered again) in backward.

    before:  un(0.w) un(0.b) mm un(1.w) un(1.b) mm un(2.w) un(2.b) mm un(norm.w) un(norm.b) ln
             ln_bw rg(norm.w) rg(norm.b) mm mm rg(2.b) rg(2.w) mm mm rg(1.b) rg(1.w) mm rg(0.b) rg(0.w)
    after:   ag(0.w) wait(0.w) ag(0.b) wait(0.b) mm ag(1.w) wait(1.w) ag(1.b) wait(1.b) mm
             ag(2.w) wait(2.w) ag(2.b) wait(2.b) mm ag(norm.w) wait(norm.w) ag(norm.b) wait(norm.b) ln
             ln_bw rs(norm.w) wait(norm.w) rs(norm.b) wait(norm.b) mm mm rs(2.b) wait(2.b) rs(2.w) wait(2.w)
             mm mm rs(1.b) wait(1.b) rs(1.w) wait(1.w) mm rs(0.b) wait(0.b) rs(0.w) wait(0.w)
    """
    joint = stage(Stack, "joint")
    assert events(joint) == drawing("before")
    (group,) = {arg(n, "group_name") for n in joint.graph.nodes if is_op(n, torch.ops.autoshard.unshard)}
    lower_annotations(joint, reshard_after_forward=True)
    assert events(joint) == drawing("after")
    reduces = [n for n in joint.graph.nodes if n.target is c10d.reduce_scatter_tensor.default]
    assert {(arg(g, "group_name"), arg(g, "group_size")) for g in gathers(joint)} == {(group, WORLD)}
    assert {(arg(r, "group_name"), arg(r, "group_size"), arg(r, "reduce_op")) for r in reduces} == {(group, WORLD, "avg")}
    assert all(recompute_region(g) is not None for g in gathers(joint))


def test_lower_by_default_keeps_what_the_backward_needs_first(drawing):
    """Each parameter's flag left to the lowering (``autoshard.shard``'s default): the last
    block (layers.2) and the norm used after it stay gathered for the backward, which starts
    with them; the other blocks are gathered again (/R: recompute, -: untagged).

    after:  ag(0.w)/R ag(0.b)/R ag(1.w)/R ag(1.b)/R ag(2.w)/- ag(2.b)/- ag(norm.w)/- ag(norm.b)/-
    """
    joint = stage(Stack, "joint")
    assert {arg(n, "reshard") for n in joint.graph.nodes if is_op(n, torch.ops.autoshard.unshard)} == {None}
    assert policies(lower_annotations(joint)) == drawing("after")


def test_lower_without_reshard_tags_nothing_for_recompute(drawing):
    """reshard_after_forward=False: no gather is tagged (/R: recompute, -: untagged), so the
    partitioner may save gathered parameters for backward.

    after:  ag(0.w)/- ag(0.b)/- ag(1.w)/- ag(1.b)/- ag(2.w)/- ag(2.b)/- ag(norm.w)/- ag(norm.b)/-
    """
    joint = lower_annotations(stage(Stack, "joint"), reshard_after_forward=False)
    assert policies(joint) == drawing("after")
    assert not any(recompute_region(n) is not None for n in joint.graph.nodes)  # nor their pads, waits, slices


def _gather_chain(gm: fx.GraphModule, param: str) -> list[fx.Node]:
    """The nodes from ``param``'s shard (a placeholder) to the full parameter: what lowering
    made of its unshard."""
    (gather,) = [g for g in gathers(gm) if g.meta[PARAMS] == (param,)]
    chain, node = [gather], gather.args[0]
    while node.op == "call_function":
        chain.insert(0, node)
        node = node.args[0]
    while len(chain[-1].users) == 1 and next(iter(chain[-1].users)).target in (c10d.wait_tensor.default, torch.ops.aten.slice.Tensor):
        chain.append(next(iter(chain[-1].users)))
    return chain


@pytest.mark.parametrize("rank", [0, 3])
def test_lower_pads_short_shards_and_cuts_the_padding_off(rank, drawing):
    """layers.2.weight has 6 rows over 4 ranks: 2 rows each on ranks 0-2, none on rank 3.
    Rank 3 pads its empty shard to 2 rows, the others by 0 rows (so every rank compiles the
    same graph), with autoshard's own pad, which no compiler drops as a no-op where nothing is
    missing; every rank gathers 8 rows and keeps the first 6.

    rank 0:  pad_shard ag(2.w) wait(2.w) slice
    rank 3:  pad_shard ag(2.w) wait(2.w) slice

    (The shard is a plain leaf, autoshard.runtime.leaves: no DTensor to_local view before it.)
    """
    chain = _gather_chain(lower_annotations(stage(Stack, "joint", rank)), "layers.2.weight")
    assert [label(n) or n.target._opname for n in chain] == drawing(f"rank {rank}")
    assert (arg(chain[-1], "dim"), arg(chain[-1], "start"), arg(chain[-1], "end")) == (0, 0, 6)
    assert arg(chain[0], "rows") == 2 and val(chain[0].args[0]).shape[0] == (0 if rank == 3 else 2)


# bucket_collectives (partitioned forward / backward) ---------------------------------------


def test_bucket_gathers_one_block_at_a_time_and_a_small_leftover_joins_the_last(drawing):
    """One gather per block, where its first member was; the final norm (64 bytes, under a
    quarter of block 2's 288) joins block 2's bucket.

    before:  ag(0.w) wait(0.w) ag(0.b) wait(0.b) mm ag(1.w) wait(1.w) ag(1.b) wait(1.b) mm
             ag(2.w) wait(2.w) ag(2.b) wait(2.b) mm ag(norm.w) wait(norm.w) ag(norm.b) wait(norm.b) ln
    after:   ag(0.w+0.b) wait(0.w+0.b) mm ag(1.w+1.b) wait(1.w+1.b) mm
             ag(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    """
    forward = stage(Stack, "forward")
    assert events(forward) == drawing("before")
    bucket_collectives(forward)
    assert events(forward) == drawing("after")
    # One flat buffer per bucket: every rank's padded shards of its members, concatenated.
    assert [g.meta["val"].numel() for g in gathers(forward)] == [WORLD * (16 + 2)] * 2 + [WORLD * (16 + 2 + 2 + 2)]


def test_bucket_reduces_each_block_where_its_last_gradient_was(drawing):
    """Reduce-scatters per block (the norm joins the block after it in backward order),
    issued where the bucket's last member was; backward re-gathers are bucketed alike.

    before:  ag(norm.w) wait(norm.w) ag(norm.b) wait(norm.b) ln_bw rs(norm.w) wait(norm.w)
             rs(norm.b) wait(norm.b) ag(2.w) wait(2.w) mm mm rs(2.b) wait(2.b) rs(2.w) wait(2.w)
             ag(1.w) wait(1.w) mm mm rs(1.b) wait(1.b) rs(1.w) wait(1.w) mm rs(0.b) wait(0.b) rs(0.w) wait(0.w)
    after:   ag(norm.w+norm.b+2.w) wait(norm.w+norm.b+2.w) ln_bw mm mm
             rs(norm.w+norm.b+2.b+2.w) wait(norm.w+norm.b+2.b+2.w)
             ag(1.w) wait(1.w) mm mm rs(1.b+1.w) wait(1.b+1.w) mm rs(0.b+0.w) wait(0.b+0.w)
    """
    backward = stage(Stack, "backward")
    assert events(backward) == drawing("before")
    bucket_collectives(backward)
    assert events(backward) == drawing("after")


def test_bucket_size_cap_splits_a_bucket(drawing):
    """A cap of 288 bytes fits a whole block (weight 256 + bias 32) but not the norm on top.

    after:   ag(0.w+0.b) wait(0.w+0.b) mm ag(1.w+1.b) wait(1.w+1.b) mm
             ag(2.w+2.b) wait(2.w+2.b) mm ag(norm.w+norm.b) wait(norm.w+norm.b) ln
    """
    assert events(bucket_collectives(stage(Stack, "forward"), bucket_mb=288 / 2**20)) == drawing("after")


@pytest.mark.parametrize("side", ["forward", "backward"])
def test_opaque_copies_bucket_alike_with_one_copy_in_and_one_copy_out_per_bucket(side):
    """With ``opaque_copies`` the same collectives sit at the same places. Each bucket's
    copy-in is one copy_in call (a reduce-scatter's lays out one row per rank) and its
    copy-out one copy_out call, from which each parameter is taken right away: for the step
    model a storage of its own, tagged gathered (the list holds none)."""
    fused, opaque = bucket_collectives(stage(Stack, side)), bucket_collectives(stage(Stack, side), opaque_copies=True)
    assert events(opaque) == events(fused)
    nodes = [n for n in opaque.graph.nodes if n.op != "output"]
    buckets = [n for n in nodes if collective_kind(n) is not None and len(n.meta[PARAMS]) > 1]
    assert buckets and all(b.args[0].target is COPY_IN for b in buckets)
    assert [b.args[0].args[1] for b in buckets] == [WORLD if collective_kind(b) == "reduce_scatter" else 1 for b in buckets]
    copy_outs = [n for n in nodes if n.target is COPY_OUT]
    assert len(copy_outs) == sum(collective_kind(b) == "all_gather" for b in buckets)
    storages = Storages(nodes)
    for out in copy_outs:
        parts = list(out.users)
        assert storages.size[out] == 0 and all(storages.root[p] is p and p.meta[GATHERED] for p in parts)
        assert sum(storages.size[p] for p in parts) == nbytes(out.args[0])  # every gathered byte, copied once
    assert not any(n.target in (torch.ops.aten.cat.default, torch.ops.aten.clone.default) for n in nodes)
