"""The gloo passes alone: gathers into buffers, in place, freed buffers, reductions by exchange.

Each test takes the stage a pass consumes (recorded from one compile with schedule "none",
so no pass beyond lowering has run; see pass_graphs.py for the graphs and the notation), runs
only that pass on a copy, and compares the sequence of communication and compute nodes with
the one its docstring draws.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from autoshard._compat import c10d, compile_fx_inner, run_and_get_code
from autoshard.passes import (
    free_collective_buffers,
    gather_inputs_held,
    gathers_in_place,
    gathers_into_buffers,
    reductions_by_exchange,
    schedule_overlap,
)
from autoshard.passes.graph_utils import PARAMS, arg, collective_kind, wait_of
from autoshard.passes.schedule_config import ScheduleConfig
from autoshard.passes.step_model import Storages, peak_bytes

from fake_pg import fake_world
from pass_graphs import WORLD, bucketed, events, gathers, label, matmuls_take_one


def test_gathers_over_gloo_write_into_buffers(drawing):
    """Each gather becomes one into a fresh buffer of its result's shape, in place; its wait and
    its uses stay. Groups that do not need it (here: all, with needed=False) keep the op.

    before: ag(0.w+0.b) wait(0.w+0.b) mm ag(1.w+1.b) wait(1.w+1.b) mm
            ag(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    after:  empty ag_out(0.w+0.b) wait(0.w+0.b) mm empty ag_out(1.w+1.b) wait(1.w+1.b) mm
            empty ag_out(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    """
    forward = bucketed("forward")
    assert events(forward) == drawing("before")
    assert events(gathers_into_buffers(bucketed("forward"), needed=lambda group: False)) == drawing("before")
    results = [n.meta["val"].shape for n in gathers(forward)]
    gathers_into_buffers(forward, needed=lambda group: True)
    assert events(forward) == drawing("after")
    into = forward.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor_out.default)
    assert [n.kwargs["out"].meta["val"].shape for n in into] == [n.meta["val"].shape for n in into] == results
    assert all(list(n.users) == [next(iter(n.users))] and next(iter(n.users)).target is c10d.wait_tensor.default for n in into)
    assert events(gathers_into_buffers(forward, needed=lambda group: True)) == drawing("after")  # idempotent
    peak = peak_bytes([n for n in forward.graph.nodes if n.op != "output"])[0]
    assert peak == peak_bytes([n for n in bucketed("forward").graph.nodes if n.op != "output"])[0]  # the buffer is the result


def test_gathers_over_gloo_concatenate_the_shards_into_this_ranks_part_of_the_buffer(drawing):
    """The cat of a bucket's shards (the gather's copy-in) writes straight into this rank's
    rows of the gather's buffer, which is allocated where the cat was: the order of
    collectives and compute is unchanged, one copy-in fewer is alive while a gather runs.

    before: empty ag_out(0.w+0.b) wait(0.w+0.b) mm empty ag_out(1.w+1.b) wait(1.w+1.b) mm
            empty ag_out(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    after:  empty ag_out(0.w+0.b) wait(0.w+0.b) mm empty ag_out(1.w+1.b) wait(1.w+1.b) mm
            empty ag_out(2.w+2.b+norm.w+norm.b) wait(2.w+2.b+norm.w+norm.b) mm ln
    """
    forward = gathers_into_buffers(bucketed("forward"), needed=lambda group: True)
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
    forward = gathers_into_buffers(bucketed("forward"), needed=lambda group: True)
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
    before = gathers_into_buffers(bucketed("forward"), needed=lambda group: True)
    # The frees sit at the last uses: the step model's peak is the one it predicted without them.
    assert peak_bytes([n for n in forward.graph.nodes if n.op != "output"])[0] == \
        peak_bytes([n for n in before.graph.nodes if n.op != "output"])[0]


def test_reduce_scatters_over_gloo_become_all_to_alls_and_a_mean_over_ranks(drawing):
    """A reduce-scatter as an all-to-all (the bytes of a reduce-scatter, where gloo's own moves
    an all-reduce's): each rank receives every rank's copy of its chunk, and a mean over the
    ranks after the wait takes the old result's place; the graph then frees the bucket and
    what it received.

    before: rs(norm.w+norm.b+2.b+2.w) rs(1.b+1.w) wait(norm.w+norm.b+2.b+2.w) rs(0.b+0.w) wait(1.b+1.w) wait(0.b+0.w)
    after:  a2a(norm.w+norm.b+2.b+2.w) a2a(1.b+1.w) wait(norm.w+norm.b+2.b+2.w) a2a(0.b+0.w) wait(1.b+1.w)
            wait(0.b+0.w)
    """
    backward = bucketed("backward")
    schedule_overlap(backward, ScheduleConfig(matmuls_take_one, lambda n: 1.5))
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


def _in_flight_step(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sent = w * 2                                                        # [16, 8]: a buffer Inductor plans
    gathered = c10d.all_gather_into_tensor(sent, 2, dist.group.WORLD.group_name)  # [32, 8], in flight
    other = torch.mm(x, y)                                              # [16, 8]: computed meanwhile
    return c10d.wait_tensor(gathered) * 3, other


def _reused_while_in_flight(code: str) -> list[str]:
    """The buffers Inductor's code hands to another tensor (its ``# reuse`` lines) between a
    gather-into-buffer's call and its wait while the gather sends from them (through its
    ``a = b`` renames too)."""
    sending: dict[str, str] = {}  # the gather's input -> its buffer, until the wait
    reused = []
    for line in code.splitlines():
        if m := re.search(r"all_gather_into_tensor_out\.default\((\w+), .*out=(\w+)\)", line):
            sending[m[1]] = m[2]
        elif m := re.search(r"wait_tensor\.default\((\w+)\)", line):
            sending = {x: out for x, out in sending.items() if out != m[1]}
        elif m := re.search(r"^\s*(\w+) = (\w+)$", line):  # a rename: the new name sends too
            sending.update({m[1]: out for x, out in sending.items() if x == m[2]})
        elif (m := re.search(r"del (\w+)  # reuse", line)) and m[1] in sending:
            reused.append(m[1])
    return reused


def test_under_inductor_a_gathers_input_is_not_reused_before_its_wait():
    """The storage an all-gather sends from stays its own until the wait: gloo reads it on its
    own thread meanwhile. Inductor knows that of out-of-place collectives, not of the _out form
    gathers_into_buffers makes: it handed the input's storage to the next tensor of its size
    (the matmul here; a ViT's pixels in the wild, gradients silently wrong).

    before: ag_out(w) mm wait
    after:  send_buffer ag_out(send_buffer) mm wait hold(send_buffer)
    """
    args = (torch.randn(16, 8), torch.randn(16, 4), torch.randn(4, 8))
    graphs, codes = {}, {}
    with fake_world(2):
        for held in (False, True):
            gm = graphs[held] = make_fx(_in_flight_step)(*args)
            gathers_into_buffers(gm, needed=lambda group: True)
            if held:
                gather_inputs_held(gm, needed=lambda group: True)
                gather_inputs_held(gm, needed=lambda group: True)  # idempotent
            _, (codes[held],) = run_and_get_code(lambda: compile_fx_inner(gm, list(args))(list(args)))
    assert _reused_while_in_flight(codes[False])  # the hazard is real: this graph shows it
    assert not _reused_while_in_flight(codes[True])
    (gather,) = graphs[True].graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor_out.default)
    sent = arg(gather, "input")
    assert sent.target is torch.ops.autoshard.send_buffer.default
    holds = graphs[True].graph.find_nodes(op="call_function", target=torch.ops.autoshard.hold.default)
    assert [(arg(h, "done"), arg(h, "held")) for h in holds] == [(wait_of(gather), [sent])]
