"""Each graph pass alone, on the graphs of a 3-layer MLP (and of a 2-layer one with a tied
weight) compiled at world size 4 on the fake process group.

Each test takes the stage a pass consumes (recorded from one compile with schedule "none",
so no pass beyond lowering has run), runs only that pass on a copy, and compares the
sequence of communication and compute nodes with the one its docstring draws. Notation:

    un(p) / rg(p)    autoshard::unshard / reduce_grad annotation of parameter p
    ag / rs (p+q)    all_gather_into_tensor / reduce_scatter_tensor moving p and q
    ag_out(p)        all_gather_into_tensor_out: the gather of p into a buffer
    a2a(p)           all_to_all_single: p's gradients exchanged, as a reduce-scatter over gloo
    empty / free     a buffer allocated (aten.empty) / its storage freed (resize_storage_bytes_ to 0)
    wait(p+q)        wait_tensor of that collective
    mm  ln  ln_bw  add   matmul (mm, addmm), layer norm forward / backward, add

Parameters are written short: layers.0.weight is 0.w, norm.bias is norm.b.
"""
from __future__ import annotations

import copy
import inspect
import re
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from autoshard._compat import c10d, recompute_region
from autoshard.compiler.bucket_plan import Timing, choose_bucket_mb, step_time_floor
from autoshard.compiler.cost_model import collective_of
from autoshard.passes import (
    bucket_collectives,
    free_collective_buffers,
    gathers_in_place,
    gathers_into_buffers,
    lower_annotations,
    merge_shared_parameters,
    reductions_by_exchange,
    schedule_overlap,
)
from autoshard.passes.graph_utils import COPY_IN, COPY_OUT, GATHERED, PARAMS, collective_kind, is_op, nbytes
from autoshard.passes.schedule import PLAN, SchedulePlan
from autoshard.passes.step_model import Storages, peak_bytes, release_points, step_time

from fake_pg import compile_step

WORLD = 4
annotations = torch.ops.autoshard
COLLECTIVES = {c10d.all_gather_into_tensor.default: "ag", c10d.all_gather_into_tensor_out.default: "ag_out",
               c10d.reduce_scatter_tensor.default: "rs", c10d.all_to_all_single.default: "a2a"}
COMPUTE = {"mm": "mm", "addmm": "mm", "native_layer_norm": "ln", "native_layer_norm_backward": "ln_bw", "add": "add",
           "empty": "empty", "resize_storage_bytes_": "free"}


class Stack(nn.Module):
    """Three blocks (layers.0-2; the last has 6 rows, uneven over 4 ranks) and a final norm
    outside the blocks, small enough to join the last block's bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 6)])
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(self.norm(x), y)


class Tied(nn.Module):
    """Two linear layers sharing one weight under two names (inp.weight, out.weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(torch.tanh(self.inp(x))), y)


_compiled: dict[tuple, dict[str, fx.GraphModule]] = {}


def stage(model: type[nn.Module], name: str, rank: int = 0) -> fx.GraphModule:
    """A copy of stage ``name`` (``joint``, ``lowered``, ``forward``, ``backward``) of ``model``'s graph,
    compiled once per (model, rank) with schedule "none"."""
    key = (model, rank)
    if key not in _compiled:
        torch.manual_seed(0)
        step = compile_step(model, lambda: (torch.randn(2, 8), torch.randn(2, 8 if model is Tied else 6)),
                            world_size=WORLD, rank=rank, options={"schedule": "none"})
        (_compiled[key],) = step.graphs.compiled
    gm = _compiled[key][name]
    with warnings.catch_warnings():  # copying pytree specs warns of a deprecation inside torch
        warnings.simplefilter("ignore", FutureWarning)
        return fx.GraphModule(gm, copy.deepcopy(gm.graph))  # passes work in place; node meta (fake values) is kept


def arg(node: fx.Node, name: str) -> Any:
    """Argument ``name`` of an op call, found through the op's schema."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, a.default_value)
    raise KeyError(name)


def _short(name: str) -> str:
    return re.sub(r"\.weight$", ".w", re.sub(r"\.bias$", ".b", name.removeprefix("layers.")))


def _params(node: fx.Node) -> str:
    return "+".join(map(_short, node.meta[PARAMS]))


def label(node: fx.Node) -> str | None:
    """The node as the drawings write it; None for nodes they leave out."""
    if node.op != "call_function":
        return None
    if is_op(node, annotations.unshard):
        return f"un({_short(arg(node, 'name'))})"
    if is_op(node, annotations.reduce_grad):
        return f"rg({_short(arg(node, 'name'))})"
    if node.target in COLLECTIVES:
        return f"{COLLECTIVES[node.target]}({_params(node)})"
    if node.target is c10d.wait_tensor.default:
        return f"wait({_params(arg(node, 'tensor'))})"
    return COMPUTE.get(getattr(node.target, "_opname", None))


def events(gm: fx.GraphModule) -> list[str]:
    return [e for e in map(label, gm.graph.nodes) if e is not None]


@pytest.fixture
def drawing(request) -> Callable[[str], list[str]]:
    """``drawing("before")``: the events the test's docstring draws on its line ``before: ...``
    and the indented lines under it. The assertions compare against the drawing itself."""
    lines = inspect.getdoc(request.function).splitlines()

    def get(name: str) -> list[str]:
        for i, line in enumerate(lines):
            if line.startswith(f"{name}:"):
                found = line.split(":", 1)[1].split()
                for more in lines[i + 1:]:
                    if not more.startswith(" ") or not more.strip():
                        break
                    found += more.split()
                return found
        raise KeyError(f"{request.function.__name__} draws no {name!r}")

    return get


def _gathers(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]


_POLICIES = {"MUST_RECOMPUTE": "R", "MUST_SAVE": "S"}


def _policies(gm: fx.GraphModule) -> list[str]:
    """Each gather with R (MUST_RECOMPUTE: gathered again in backward), S (MUST_SAVE) or - (untagged)."""
    return [f"{label(g)}/{_POLICIES.get(getattr(g.meta.get('recompute'), 'name', None), '-')}" for g in _gathers(gm)]


# merge_shared_parameters (joint graph, before lowering) ----------------------------------


def test_merge_shared_gathers_a_tied_weight_once_and_reduces_the_summed_gradient_once(drawing):
    """inp.weight and out.weight are one shard: two annotations become one each way.

    before:  un(inp.w) mm un(out.w) mm mm mm rg(out.w) mm rg(inp.w) add
    after:   un(inp.w) mm mm mm mm mm add rg(out.w)
    """
    joint = stage(Tied, "joint")
    assert events(joint) == drawing("before")
    merge_shared_parameters(joint)
    assert events(joint) == drawing("after")
    (unshard,) = [n for n in joint.graph.nodes if is_op(n, annotations.unshard)]
    (reduce,) = [n for n in joint.graph.nodes if is_op(n, annotations.reduce_grad)]
    # The kept gather now feeds both matmuls; the reduce takes the sum of both uses' gradients.
    assert len([u for u in unshard.users if u.target is torch.ops.aten.t.default]) == 2
    assert arg(reduce, "grad").target is torch.ops.aten.add.Tensor
    assert arg(reduce, "shard_rows") == 8 // WORLD


# lower_annotations (joint graph) ----------------------------------------------------------


def test_lower_turns_annotations_into_collectives_and_waits(drawing):
    """Each unshard becomes a gather and its wait, each reduce_grad a reduce-scatter and its
    wait, in place; gathers are tagged to be recomputed (gathered again) in backward.

    before:  un(0.w) un(0.b) mm un(1.w) un(1.b) mm un(2.w) un(2.b) mm un(norm.w) un(norm.b) ln
             ln_bw rg(norm.b) rg(norm.w) mm mm rg(2.b) rg(2.w) mm mm rg(1.b) rg(1.w) mm rg(0.b) rg(0.w)
    after:   ag(0.w) wait(0.w) ag(0.b) wait(0.b) mm ag(1.w) wait(1.w) ag(1.b) wait(1.b) mm
             ag(2.w) wait(2.w) ag(2.b) wait(2.b) mm ag(norm.w) wait(norm.w) ag(norm.b) wait(norm.b) ln
             ln_bw rs(norm.b) wait(norm.b) rs(norm.w) wait(norm.w) mm mm rs(2.b) wait(2.b) rs(2.w) wait(2.w)
             mm mm rs(1.b) wait(1.b) rs(1.w) wait(1.w) mm rs(0.b) wait(0.b) rs(0.w) wait(0.w)
    """
    joint = stage(Stack, "joint")
    assert events(joint) == drawing("before")
    (group,) = {arg(n, "group_name") for n in joint.graph.nodes if is_op(n, annotations.unshard)}
    lower_annotations(joint)
    assert events(joint) == drawing("after")
    reduces = [n for n in joint.graph.nodes if n.target is c10d.reduce_scatter_tensor.default]
    assert {(arg(g, "group_name"), arg(g, "group_size")) for g in _gathers(joint)} == {(group, WORLD)}
    assert {(arg(r, "group_name"), arg(r, "group_size"), arg(r, "reduce_op")) for r in reduces} == {(group, WORLD, "avg")}
    assert all(recompute_region(g) is not None for g in _gathers(joint))


def test_lower_without_reshard_tags_nothing_for_recompute(drawing):
    """reshard_after_forward=False: no gather is tagged (/R: recompute, -: untagged), so the
    partitioner may save gathered parameters for backward.

    after:  ag(0.w)/- ag(0.b)/- ag(1.w)/- ag(1.b)/- ag(2.w)/- ag(2.b)/- ag(norm.w)/- ag(norm.b)/-
    """
    joint = lower_annotations(stage(Stack, "joint"), reshard_after_forward=False)
    assert _policies(joint) == drawing("after")
    assert not any(recompute_region(n) is not None for n in joint.graph.nodes)  # nor their pads, waits, slices


def _gather_chain(gm: fx.GraphModule, param: str) -> list[fx.Node]:
    """The nodes from ``param``'s shard (a placeholder) to the full parameter: what lowering
    made of its unshard."""
    (gather,) = [g for g in _gathers(gm) if g.meta[PARAMS] == (param,)]
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
    same graph); every rank gathers 8 rows and keeps the first 6.

    rank 0:  constant_pad_nd ag(2.w) wait(2.w) slice
    rank 3:  constant_pad_nd ag(2.w) wait(2.w) slice

    (The shard is a plain leaf, autoshard.runtime.leaves: no DTensor to_local view before it.)
    """
    chain = _gather_chain(lower_annotations(stage(Stack, "joint", rank)), "layers.2.weight")
    assert [label(n) or n.target._opname for n in chain] == drawing(f"rank {rank}")
    assert (arg(chain[-1], "dim"), arg(chain[-1], "start"), arg(chain[-1], "end")) == (0, 0, 6)
    assert arg(chain[0], "pad") == [0, 0, 0, 2 if rank == 3 else 0]  # dim 0 (the last pair) grows by 2 rows on rank 3


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
    assert [g.meta["val"].numel() for g in _gathers(forward)] == [WORLD * (16 + 2)] * 2 + [WORLD * (16 + 2 + 2 + 2)]


def test_bucket_reduces_each_block_where_its_last_gradient_was(drawing):
    """Reduce-scatters per block (the norm joins the block after it in backward order),
    issued where the bucket's last member was; backward re-gathers are bucketed alike.

    before:  ag(norm.w) wait(norm.w) ag(norm.b) wait(norm.b) ln_bw rs(norm.b) wait(norm.b)
             rs(norm.w) wait(norm.w) ag(2.w) wait(2.w) mm mm rs(2.b) wait(2.b) rs(2.w) wait(2.w)
             ag(1.w) wait(1.w) mm mm rs(1.b) wait(1.b) rs(1.w) wait(1.w) mm rs(0.b) wait(0.b) rs(0.w) wait(0.w)
    after:   ag(norm.w+norm.b+2.w) wait(norm.w+norm.b+2.w) ln_bw mm mm
             rs(norm.b+norm.w+2.b+2.w) wait(norm.b+norm.w+2.b+2.w)
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


# schedule_overlap (bucketed forward / backward) ---------------------------------------------


def _matmuls_take_one(node: fx.Node) -> float:
    """Compute time: 1 per matmul, nothing else; collective times are in the same unit."""
    return 1.0 if label(node) == "mm" else 0.0


def _bucketed(name: str) -> fx.GraphModule:
    """The input schedule_overlap gets in the backend: a partitioned graph after bucketing."""
    return bucket_collectives(stage(Stack, name))


@pytest.mark.parametrize("gather_time, max_prefetch, expected", [
    (0.5, 2, "1 ahead"),  # one block's matmul covers a gather
    (1.5, 2, "2 ahead"),  # two blocks' are needed
    (1.5, 1, "1 ahead"),  # ... but max_prefetch allows one
])
def test_schedule_prefetches_gathers_as_far_as_their_time_needs(gather_time, max_prefetch, expected, drawing):
    """Each gather is issued the fewest blocks ahead whose matmuls cover its time (at most
    max_prefetch) and waited right before its first use.

    before:   ag(0.w+0.b) wait(0.w+0.b) mm ag(1.w+1.b) wait(1.w+1.b) mm
              ag(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    1 ahead:  ag(0.w+0.b) wait(0.w+0.b) ag(1.w+1.b) mm
              wait(1.w+1.b) ag(2.w+2.b+norm.w+norm.b) mm wait(2.w+2.b+norm.w+norm.b) mm ln
    2 ahead:  ag(0.w+0.b) ag(1.w+1.b) wait(0.w+0.b) ag(2.w+2.b+norm.w+norm.b)
              mm wait(1.w+1.b) mm wait(2.w+2.b+norm.w+norm.b) mm ln

    Where a wait and an issue meet, the wait comes first: the comm stream runs them in turn
    anyway, and one collective in flight holds one buffer (and on gloo one workspace), not two.
    """
    forward = _bucketed("forward")
    assert events(forward) == drawing("before")
    schedule_overlap(forward, _matmuls_take_one, lambda n: gather_time, max_prefetch=max_prefetch)
    assert events(forward) == drawing(expected)


def _gathered_bytes(gather: fx.Node) -> int:
    """What a gather bucket keeps alive: its flat result and the per-parameter copies of it."""
    return 2 * gather.meta["val"].numel() * gather.meta["val"].element_size()


def test_schedule_prefetches_less_to_stay_within_the_memory_bound(drawing):
    """On the bucketed forward drawn above: gathers want 2 blocks ahead (time 1.5), but the
    bound holds only blocks 1 and 2 at once, so the last gather is issued once block 0's
    parameters are dead, 1 block ahead. A bound below the largest bucket is an error.

    after:  ag(0.w+0.b) ag(1.w+1.b) wait(0.w+0.b) mm
            wait(1.w+1.b) ag(2.w+2.b+norm.w+norm.b) mm wait(2.w+2.b+norm.w+norm.b) mm ln
    """
    forward = _bucketed("forward")
    _, second, third = _gathers(forward)
    bound = _gathered_bytes(second) + _gathered_bytes(third)
    schedule_overlap(forward, _matmuls_take_one, lambda n: 1.5, max_inflight_bytes=bound)
    assert events(forward) == drawing("after")
    with pytest.raises(ValueError, match="option 'max_inflight_mb': .* MiB is below the"):  # not even gathering at use fits
        schedule_overlap(_bucketed("forward"), _matmuls_take_one, lambda n: 1.5, max_inflight_bytes=_gathered_bytes(third) - 1)


@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_schedule_issues_reductions_early_and_waits_buckets_later(in_flight, drawing):
    """A reduce-scatter is issued right after its last gradient and waited right before the
    one in_flight buckets later is issued (or at the end; 0: right after its own issue, as
    FSDP2 eager's blocking collectives on CPU); re-gathers are prefetched.

    before:  ag(norm.w+norm.b+2.w) wait(norm.w+norm.b+2.w) ln_bw mm mm
             rs(norm.b+norm.w+2.b+2.w) wait(norm.b+norm.w+2.b+2.w)
             ag(1.w) wait(1.w) mm mm rs(1.b+1.w) wait(1.b+1.w) mm rs(0.b+0.w) wait(0.b+0.w)
    0:       ag(norm.w+norm.b+2.w) wait(norm.w+norm.b+2.w) ag(1.w) ln_bw mm mm
             rs(norm.b+norm.w+2.b+2.w) wait(norm.b+norm.w+2.b+2.w) wait(1.w) mm mm
             rs(1.b+1.w) wait(1.b+1.w) mm rs(0.b+0.w) wait(0.b+0.w)
    1:       ag(norm.w+norm.b+2.w) wait(norm.w+norm.b+2.w) ag(1.w) ln_bw mm mm
             rs(norm.b+norm.w+2.b+2.w) wait(1.w) mm mm wait(norm.b+norm.w+2.b+2.w)
             rs(1.b+1.w) mm wait(1.b+1.w) rs(0.b+0.w) wait(0.b+0.w)
    2:       ag(norm.w+norm.b+2.w) wait(norm.w+norm.b+2.w) ag(1.w) ln_bw mm mm
             rs(norm.b+norm.w+2.b+2.w) wait(1.w) mm mm rs(1.b+1.w) mm
             wait(norm.b+norm.w+2.b+2.w) rs(0.b+0.w) wait(1.b+1.w) wait(0.b+0.w)
    """
    backward = _bucketed("backward")
    assert events(backward) == drawing("before")
    schedule_overlap(backward, _matmuls_take_one, lambda n: 0.5, max_reduces_in_flight=in_flight)
    assert events(backward) == drawing(str(in_flight))


def test_a_blocked_gather_is_waited_at_its_issue_and_its_result_kept_until_its_use(drawing):
    """A blocked bucket (FSDP2 eager's gathers on gloo block their caller) keeps its prefetch
    distance, but its wait comes right after its issue; the use stays where it was. So its
    workspace never meets the compute that follows, and the reference policy, blocked, holds
    less at its peak than the same policy in flight.

    before:  ag(0.w+0.b) wait(0.w+0.b) mm ag(1.w+1.b) wait(1.w+1.b) mm
             ag(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    after:   ag(0.w+0.b) wait(0.w+0.b) ag(1.w+1.b) wait(1.w+1.b) mm
             ag(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm mm ln
    """
    forward = _bucketed("forward")
    assert events(forward) == drawing("before")
    n = len(_gathers(forward))
    schedule_overlap(forward, _matmuls_take_one, lambda x: 1.5, plan=SchedulePlan((1,) * n, 0, blocked=(True,) * n))
    assert events(forward) == drawing("after")
    workspace = lambda x: nbytes(x) if collective_kind(x) == "all_gather" else 0  # noqa: E731  a staging copy as large as the result
    reference = {}
    for blocking in (False, True):
        gm = _bucketed("forward")
        schedule_overlap(gm, _matmuls_take_one, lambda x: 1.5, workspace=workspace, no_more_than=(1, 0),
                         reference_blocking=blocking, only_plan=True)
        reference[blocking] = gm.meta[PLAN].reference_bytes
    assert reference[True] < reference[False]


def _gather_time(per_largest: float, sizes: list[int]) -> Callable[[fx.Node], float]:
    """A collective's time: a latency plus ``per_largest`` for the largest bucket's bytes."""
    return lambda n: 0.05 + per_largest * nbytes(n) / max(sizes)


@pytest.mark.parametrize("per_largest, split", [(0.5, None), (2.0, 4)])
def test_bucket_plan_splits_buckets_only_when_the_budget_stops_block_buckets_prefetching(per_largest, split):
    """The default budget is FSDP2's policy (1 ahead) on block buckets. Gathers of 0.5 per
    block are hidden 1 ahead: nothing to split. Gathers of 2 want 2 ahead, which the budget
    forbids; quarter buckets, prefetched, fit the same budget and run faster."""
    sizes = [nbytes(n) for n in _bucketed("forward").graph.nodes if collective_kind(n) == "all_gather"]
    comm = _gather_time(per_largest, sizes)

    def schedule(gm: fx.GraphModule, budget: int | None) -> None:
        schedule_overlap(gm, _matmuls_take_one, comm, memory_budget_bytes=budget, no_more_than=(1, 1))

    mb, plan, _ = choose_bucket_mb(stage(Stack, "forward"), schedule, None)
    blocks = _bucketed("forward")
    schedule(blocks, None)
    if split is None:
        assert mb is None and plan == blocks.meta[PLAN] and not plan.forced
        return
    budget = blocks.meta[PLAN].budget_bytes
    assert blocks.meta[PLAN].forced and mb == max(sizes) / split / 2**20 and plan.budget_bytes == budget
    chosen = bucket_collectives(stage(Stack, "forward"), mb)
    schedule(chosen, budget)
    assert chosen.meta[PLAN] == plan  # the plan handed back is the one the schedule finds
    assert plan.peak_bytes <= budget and plan.step_time < blocks.meta[PLAN].step_time


def test_bucket_plan_meets_a_budget_block_buckets_cannot_with_smaller_ones():
    """A user's budget below the least block buckets need (gathering at use) is met by split
    buckets, which need less; below what every candidate needs it is the planner's error."""
    sizes = [nbytes(n) for n in _bucketed("forward").graph.nodes if collective_kind(n) == "all_gather"]
    comm = _gather_time(2.0, sizes)

    def schedule(gm: fx.GraphModule, budget: int | None) -> None:
        schedule_overlap(gm, _matmuls_take_one, comm, memory_budget_bytes=budget, no_more_than=(1, 1))

    blocks = _bucketed("forward")
    schedule(blocks, None)
    budget = blocks.meta[PLAN].smallest_bytes - 1
    mb, plan, chosen = choose_bucket_mb(stage(Stack, "forward"), schedule, budget)
    assert mb is not None and plan.peak_bytes <= budget
    with pytest.raises(ValueError, match="is below what this graph needs"):
        choose_bucket_mb(stage(Stack, "forward"), schedule, plan.smallest_bytes // 2)


@pytest.mark.parametrize("side", ["forward", "backward"])
@pytest.mark.parametrize("latency", [0.05, 3.0])
def test_bucket_plan_skips_only_splits_its_floor_rules_out(side, latency):
    """``step_time_floor`` is below every split's step time as the schedule finds it. With a
    latency of 3 per collective, splitting only adds collectives: the floor rules both splits
    out, so only the block buckets are bucketed and scheduled; with 0.05 both are tried.
    Either way the choice is the one found by trying every split."""
    sizes = [nbytes(n) for n in _bucketed(side).graph.nodes if collective_kind(n) == "all_gather"]
    # Bytes as the cost model counts them (a reduction's input), as Timing.comm_time takes them.
    comm = lambda n, size=None: latency + 2.0 * (collective_of(n).nbytes if size is None else size) / max(sizes)  # noqa: E731
    scheduled = []

    def schedule(gm: fx.GraphModule, budget: int | None) -> None:
        scheduled.append(gm)
        schedule_overlap(gm, _matmuls_take_one, comm, memory_budget_bytes=budget, no_more_than=(1, 1))

    timing = Timing(_matmuls_take_one, comm)
    every = choose_bucket_mb(stage(Stack, side), schedule, None)
    tried, scheduled[:] = list(scheduled), []
    skipping = choose_bucket_mb(stage(Stack, side), schedule, None, timing)
    assert every[:2] == skipping[:2] and events(every[2]) == events(skipping[2])
    for gm, parts in zip(tried[1:], (2, 4)):
        mb = max(sizes) / parts / 2**20
        assert step_time_floor(stage(Stack, side), mb, timing) <= gm.meta[PLAN].step_time
    forced = tried[0].meta[PLAN].forced
    assert len(tried) == (3 if forced else 1) and (len(scheduled) == 1) == (latency == 3.0 or not forced)


# the step model and the memory budget (bucketed forward of Stack) ---------------------------


def test_step_model_times_an_order_and_counts_workspace_until_the_wait():
    """Before scheduling (gather at use), each gather's 0.5 is exposed before its matmul (1):
    3 x 0.5 + 3 = 4.5. Prefetched one ahead, only the first is: 0.5 + 3 = 3.5; where compute
    keeps only 60% of its speed while a gather runs (overlap 0.6), each gather also costs
    compute 0.2, but the first one's is spent waiting for it anyway: 3.5 + 2 x 0.2 = 3.9. An
    issue cost adds to that (0.1 each: 3.5 + 2 x 0.3 = 4.1), but a collective never costs its
    caller more than its own time (issue cost 1: 3.5 + 2 x 0.5 = 4.5, gathering at use).
    A collective's workspace adds to the peak while it is in flight, at most once per
    collective in flight."""
    forward = _bucketed("forward")
    order = [n for n in forward.graph.nodes if n.op != "output"]
    assert step_time(order, _matmuls_take_one, lambda n: 0.5) == 4.5
    plain, _ = peak_bytes(order)
    with_workspace, _ = peak_bytes(order, lambda n: 1000)
    assert 0 < with_workspace - plain <= 1000  # gathered at use: one gather in flight at a time
    schedule_overlap(forward, _matmuls_take_one, lambda n: 0.5)
    prefetched = [n for n in forward.graph.nodes if n.op != "output"]
    assert step_time(prefetched, _matmuls_take_one, lambda n: 0.5) == 3.5
    assert step_time(prefetched, _matmuls_take_one, lambda n: 0.5, overlap=0.6) == pytest.approx(3.9)
    assert step_time(prefetched, _matmuls_take_one, lambda n: 0.5, overlap=0.6, issue_cost=0.1) == pytest.approx(4.1)
    assert step_time(prefetched, _matmuls_take_one, lambda n: 0.5, overlap=0.6, issue_cost=1.0) == pytest.approx(4.5)


def test_a_collective_whose_backend_copies_its_input_frees_it_at_the_issue():
    """gloo reduces a clone of a reduce-scatter's input (its workspace): with input_copied the
    input is not held until the wait, so reductions kept in flight cost less; the clone still
    counts. Without a workspace, the peak can only drop by the inputs' bytes."""
    backward = _bucketed("backward")
    schedule_overlap(backward, _matmuls_take_one, lambda n: 1.5)  # reductions in flight
    order = [n for n in backward.graph.nodes if n.op != "output"]
    copied = lambda n: collective_kind(n) == "reduce_scatter"  # noqa: E731
    inputs = sum(nbytes(n.args[0]) for n in order if copied(n))
    held, _ = peak_bytes(order, lambda n: nbytes(n.args[0]) if copied(n) else 0)
    freed, _ = peak_bytes(order, lambda n: nbytes(n.args[0]) if copied(n) else 0, input_copied=copied)
    assert held - inputs <= freed < held
    assert peak_bytes(order, input_copied=lambda n: False) == peak_bytes(order)
    # Reduced in place (passes/gloo.py), a reduction's result is made at its wait, not at the issue.
    later, _ = peak_bytes(order, lambda n: nbytes(n.args[0]) if copied(n) else 0, input_copied=copied,
                          output_at_wait=("reduce_scatter",))
    assert later < freed


def test_schedule_fits_a_memory_budget_and_names_the_smallest_that_fits():
    """Gathers want 2 blocks ahead (time 1.5). A budget between the peak of gathering at use
    and the peak of that plan prefetches less and fits; one below gathering at use fails,
    naming that peak; no_more_than=(1, 1) without a budget stays within FSDP2's peak."""
    def plan(**kwargs):
        forward = _bucketed("forward")
        schedule_overlap(forward, _matmuls_take_one, lambda n: 1.5, **kwargs)
        return forward.meta[PLAN]

    fast, slowest = plan(), plan(max_prefetch=0)
    assert fast.distances == (1, 2, 2) and slowest.distances == (0, 0, 0)  # nothing precedes bucket 0
    assert slowest.peak_bytes < fast.peak_bytes and slowest.step_time > fast.step_time
    budget = (fast.peak_bytes + slowest.peak_bytes) // 2
    fitted = plan(memory_budget_bytes=budget)
    assert fitted.peak_bytes <= budget < fast.peak_bytes and fitted.forced
    assert fast.step_time <= fitted.step_time <= slowest.step_time
    with pytest.raises(ValueError, match=f"option 'memory_budget_gb': .* {slowest.peak_bytes / 2**30:.3f} GiB"):
        plan(memory_budget_bytes=slowest.peak_bytes - 1)
    fsdp2 = plan(max_prefetch=1, max_reduces_in_flight=1)
    capped = plan(no_more_than=(1, 1))
    assert capped.peak_bytes <= fsdp2.peak_bytes and capped.step_time <= fsdp2.step_time


def test_late_release_keeps_a_collectives_buffers_until_the_next_issue():
    """gloo frees a finished collective's buffers on its own thread: with late_release they
    count until the next collective is issued, never less than until the wait."""
    forward = _bucketed("forward")
    order = [n for n in forward.graph.nodes if n.op != "output"]
    issues = [i for i, n in enumerate(order) if n.target is c10d.all_gather_into_tensor.default]
    on_time, late = release_points(order), release_points(order, late=("all_gather",))
    for a, b in zip(issues, issues[1:]):
        assert on_time[order[a]] < b and late[order[a]] == b  # gathered at use: the wait comes before the next issue
    assert late[order[issues[-1]]] == on_time[order[issues[-1]]]  # nothing is issued after the last
    assert peak_bytes(order, lambda n: 1000, late_release=("all_gather",))[0] >= peak_bytes(order, lambda n: 1000)[0]
    assert release_points(order, late=("reduce_scatter",)) == on_time  # only the kinds named linger


def test_gathers_over_gloo_write_into_buffers(drawing):
    """Each gather becomes one into a fresh buffer of its result's shape, in place; its wait and
    its uses stay. Groups that do not need it (here: all, with needed=False) keep the op.

    before: ag(0.w+0.b) wait(0.w+0.b) mm ag(1.w+1.b) wait(1.w+1.b) mm
            ag(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    after:  empty ag_out(0.w+0.b) wait(0.w+0.b) mm empty ag_out(1.w+1.b) wait(1.w+1.b) mm
            empty ag_out(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    """
    forward = _bucketed("forward")
    assert events(forward) == drawing("before")
    assert events(gathers_into_buffers(_bucketed("forward"), needed=lambda group: False)) == drawing("before")
    results = [n.meta["val"].shape for n in _gathers(forward)]
    gathers_into_buffers(forward, needed=lambda group: True)
    assert events(forward) == drawing("after")
    into = forward.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor_out.default)
    assert [n.kwargs["out"].meta["val"].shape for n in into] == [n.meta["val"].shape for n in into] == results
    assert all(list(n.users) == [next(iter(n.users))] and next(iter(n.users)).target is c10d.wait_tensor.default for n in into)
    assert events(gathers_into_buffers(forward, needed=lambda group: True)) == drawing("after")  # idempotent
    peak = peak_bytes([n for n in forward.graph.nodes if n.op != "output"])[0]
    assert peak == peak_bytes([n for n in _bucketed("forward").graph.nodes if n.op != "output"])[0]  # the buffer is the result


def test_gathers_over_gloo_concatenate_the_shards_into_this_ranks_part_of_the_buffer(drawing):
    """The cat of a bucket's shards (the gather's copy-in) writes straight into this rank's
    rows of the gather's buffer, which is allocated where the cat was: the order of
    collectives and compute is unchanged, one copy-in fewer is alive while a gather runs.

    before: empty ag_out(0.w+0.b) wait(0.w+0.b) mm empty ag_out(1.w+1.b) wait(1.w+1.b) mm
            empty ag_out(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    after:  empty ag_out(0.w+0.b) wait(0.w+0.b) mm empty ag_out(1.w+1.b) wait(1.w+1.b) mm
            empty ag_out(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    """
    forward = gathers_into_buffers(_bucketed("forward"), needed=lambda group: True)
    assert events(forward) == drawing("before")
    allocated = lambda gm: sum(Storages(list(gm.graph.nodes)).size.values())  # noqa: E731  every storage's bytes
    before = allocated(forward)
    into = c10d.all_gather_into_tensor_out.default
    shards = {n.meta[PARAMS]: n.args[0].meta["val"].shape for n in forward.graph.find_nodes(op="call_function", target=into)}
    gathers_in_place(forward, needed=lambda group: True, rank_of=lambda group: 1)
    assert events(forward) == drawing("after")
    order = {n: i for i, n in enumerate(forward.graph.nodes)}
    for gather in forward.graph.find_nodes(op="call_function", target=into):
        filled, buffer = gather.args[0], gather.kwargs["out"]
        assert filled.target is torch.ops.aten.cat.out
        mine = filled.kwargs["out"]
        rows = shards[gather.meta[PARAMS]][0]
        assert mine.target is torch.ops.aten.narrow.default and mine.args == (buffer, 0, rows, rows)  # rank 1's rows
        assert order[buffer] < order[mine] < order[filled] < order[gather]
    assert not forward.graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default)
    # The step model sees the copy-in as the buffer's: the shards' bytes are no longer allocated twice.
    assert all(Storages(list(forward.graph.nodes)).root[g.args[0]] is g.kwargs["out"]
               for g in forward.graph.find_nodes(op="call_function", target=into))
    assert before - allocated(forward) == sum(torch.Size(s).numel() * 4 for s in shards.values())


def test_the_graph_frees_its_gather_buffers_after_their_last_use(drawing):
    """After each gather's wait and copy-outs, its input (the cat of shards) and its buffer
    are freed by the graph; the shards (placeholders) never are.

    before: empty ag_out(0.w+0.b) wait(0.w+0.b) mm empty ag_out(1.w+1.b) wait(1.w+1.b) mm
            empty ag_out(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    after:  empty ag_out(0.w+0.b) wait(0.w+0.b) free free mm empty ag_out(1.w+1.b) wait(1.w+1.b) free free mm
            empty ag_out(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) free mm free ln

    (The last bucket's buffer goes after the norm's copy-out, which waits for the norm's use.)
    """
    forward = gathers_into_buffers(_bucketed("forward"), needed=lambda group: True)
    assert events(forward) == drawing("before")
    free_collective_buffers(forward, needed=lambda group: True)
    assert events(forward) == drawing("after")
    order = {n: i for i, n in enumerate(forward.graph.nodes)}
    frees = forward.graph.find_nodes(op="call_function", target=torch.ops.inductor.resize_storage_bytes_.default)
    freed = {n.args[0] for n in frees}
    into = forward.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor_out.default)
    assert freed == {n.kwargs["out"] for n in into} | {n.args[0] for n in into}
    assert not any(n.op == "placeholder" for n in freed)
    for free in frees:  # after every use of what it frees, through its views too
        uses = [u for n in forward.graph.nodes if n is free.args[0] or (n.args and n.args[0] is free.args[0])
                for u in n.users if u is not free]
        assert all(order[u] < order[free] for u in uses)
    before = gathers_into_buffers(_bucketed("forward"), needed=lambda group: True)
    # The frees sit at the last uses: the step model's peak is the one it predicted without them.
    assert peak_bytes([n for n in forward.graph.nodes if n.op != "output"])[0] == \
        peak_bytes([n for n in before.graph.nodes if n.op != "output"])[0]


def test_reduce_scatters_over_gloo_become_all_to_alls_and_a_mean_over_ranks(drawing):
    """A reduce-scatter as an all-to-all (the bytes of a reduce-scatter, where gloo's own moves
    an all-reduce's): each rank receives every rank's copy of its chunk, and a mean over the
    ranks after the wait takes the old result's place; the graph then frees the bucket and
    what it received.

    before: rs(norm.b+norm.w+2.b+2.w) rs(1.b+1.w) wait(norm.b+norm.w+2.b+2.w) rs(0.b+0.w) wait(1.b+1.w) wait(0.b+0.w)
    after:  a2a(norm.b+norm.w+2.b+2.w) a2a(1.b+1.w) wait(norm.b+norm.w+2.b+2.w) a2a(0.b+0.w) wait(1.b+1.w)
            wait(0.b+0.w)
    """
    backward = _bucketed("backward")
    schedule_overlap(backward, _matmuls_take_one, lambda n: 1.5)
    def comm(gm: fx.GraphModule) -> list[str]:  # the reductions and their waits
        reduces = (c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default)
        return [label(n) for n in gm.graph.nodes
                if n.target in reduces or (n.target is c10d.wait_tensor.default and n.args[0].target in reduces)]

    assert comm(backward) == drawing("before")
    results = {n.meta[PARAMS]: n.meta["val"].shape for n in backward.graph.nodes if collective_kind(n) == "reduce_scatter"}
    reductions_by_exchange(backward, needed=lambda group: True)
    assert comm(backward) == drawing("after")
    exchanges = backward.graph.find_nodes(op="call_function", target=c10d.all_to_all_single.default)
    for exchange in exchanges:
        chunk = results[exchange.meta[PARAMS]]
        assert collective_kind(exchange) == "reduce_scatter"  # priced as one
        assert exchange.args[1] == exchange.args[2] == [chunk[0]] * WORLD  # one chunk to and from every rank
        (wait,) = exchange.users
        (stacked,) = wait.users
        assert stacked.meta["val"].shape == (WORLD, *chunk)
        (mean,) = stacked.users
        assert mean.target is torch.ops.aten.mean.dim and mean.args[1] == [0] and mean.meta["val"].shape == chunk
    free_collective_buffers(backward, needed=lambda group: True)
    freed = {n.args[0] for n in backward.graph.find_nodes(op="call_function", target=torch.ops.inductor.resize_storage_bytes_.default)}
    buckets = {n.args[0].args[0] if n.args[0].target is torch.ops.aten.view.default else n.args[0] for n in exchanges}
    assert buckets <= freed and set(exchanges) <= freed  # the buckets (the cat under a view) and what they received
