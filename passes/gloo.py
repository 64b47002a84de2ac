"""What collectives over gloo need: gathers into buffers, and buffers freed by the graph."""
from __future__ import annotations

from typing import Callable

import torch
from torch import fx

from autoshard._compat import c10d

from .graph_utils import (
    PADS,
    arg,
    call,
    collective_kind,
    collectives,
    group_backend,
    group_rank,
    is_exchange,
    val,
    wait_of,
)
from .step_model import storage_roots

aten = torch.ops.aten
resize_storage_bytes_ = torch.ops.inductor.resize_storage_bytes_.default
HOLD = torch.ops.autoshard.hold.default
SEND_BUFFER = torch.ops.autoshard.send_buffer.default

# gloo runs the out-of-place all_gather_into_tensor through its coalesced all-gather work,
# which corrupts the process's heap when several gathers are in flight at once; the _out form
# runs gloo's plain all-gather work, which does not (bench/gloo_gathers.py shows both; the
# figures: docs/design.md, "6. Inner compile"). It is the form PyTorch's own bucketer emits, so
# Inductor lowers it too. Other backends keep the out-of-place op, which they run without this.


# What the passes free or reduce in place: storages these ops allocate (copy-ins, pads, casts,
# buffers). Anything else (a view of a placeholder, an op's output they do not know) stays the graph's.
_ALLOCATES = (aten.empty.memory_format, aten.cat.default, *PADS, aten.clone.default,
              torch.ops.prims.convert_element_type.default, c10d.all_to_all_single.default)


def _recompiled(gm: fx.GraphModule, changed: bool) -> fx.GraphModule:
    if changed:  # an unchanged graph keeps its code: no lint, no recompile
        gm.graph.lint()
        gm.recompile()
    return gm


def on_gloo(group_name: str) -> bool:
    return group_backend(group_name) == "gloo"


def gathers_into_buffers(gm: fx.GraphModule, needed: Callable[[str], bool] = on_gloo) -> fx.GraphModule:
    """Rewrite each all-gather over a gloo group into an all-gather into a fresh buffer.

    Guarantees: every ``all_gather_into_tensor(x, n, group)`` with ``needed(group)`` (default:
    the group's backend is gloo) becomes
    ``empty(result shape) -> all_gather_into_tensor_out(x, n, group, out=buffer)`` at the same
    place, keeping the node's meta (its parameters, its value); its wait and every use are
    unchanged, so order, numerics and collectives are too. Other groups' gathers are
    untouched; the pass is idempotent.

        before:  x -> all_gather_into_tensor(x) -> wait_tensor -> uses
        after:   x, empty -> all_gather_into_tensor_out(x, out=empty) -> wait_tensor -> uses
    """
    graph = gm.graph
    changed = False
    for gather in collectives(graph, c10d.all_gather_into_tensor.default):
        value = val(gather)
        if not isinstance(value, torch.Tensor) or not needed(arg(gather, "group_name")):
            continue
        with graph.inserting_before(gather):
            buffer = graph.call_function(
                aten.empty.memory_format, (list(value.shape),), {"dtype": value.dtype, "device": value.device}
            )
            into = graph.call_function(c10d.all_gather_into_tensor_out.default, gather.args, {"out": buffer})
        buffer.meta["val"] = value  # the buffer is the result: the _out op returns it
        into.meta.update(gather.meta)
        gather.replace_all_uses_with(into)
        graph.erase_node(gather)
        changed = True
    return _recompiled(gm, changed)


# A gather's input is this rank's part of its output: concatenating the shards straight into
# that part of the buffer (as FSDP2 copies them in) saves the separate copy-in that gloo
# would hold while the gather runs (a bucket's shards: 1/n of the buffer, per gather in flight).


def gathers_in_place(
    gm: fx.GraphModule, needed: Callable[[str], bool] = on_gloo, rank_of: Callable[[str], int] = group_rank
) -> fx.GraphModule:
    """Concatenate each bucketed gather's shards into this rank's part of its buffer.

    Guarantees: ``cat(shards) -> all_gather_into_tensor_out(cat, out=empty)`` over a ``needed``
    group, where the cat is read by nothing else, becomes ``empty -> narrow(empty, this
    rank's rows) -> cat.out(shards, out=narrow) -> all_gather_into_tensor_out(narrow,
    out=empty)``, the buffer allocated where the cat was: the same bytes gathered into the same
    buffer, one copy-in fewer alive while the gather runs. The graph becomes rank-specific
    (``rank_of(group)`` parts in): run it after the ranks' plans are compared. Other gathers
    are untouched; run after :func:`gathers_into_buffers`.

        before:  cat(shards) -> empty -> gather(cat, out=empty) -> wait
        after:   empty -> narrow -> cat.out(shards, out=narrow) -> gather(narrow, out=empty) -> wait
    """
    graph = gm.graph
    changed = False
    for gather in collectives(graph, c10d.all_gather_into_tensor_out.default):
        flat, buffer, group = arg(gather, "input"), gather.kwargs["out"], arg(gather, "group_name")
        if not needed(group) or flat.target is not aten.cat.default or len(flat.users) != 1:
            continue
        rows = val(flat).shape[0]
        with graph.inserting_before(flat):
            into = graph.call_function(buffer.target, buffer.args, buffer.kwargs)
            into.meta["val"] = val(buffer)
            mine = call(graph, aten.narrow.default, into, 0, rank_of(group) * rows, rows)
            filled = graph.call_function(aten.cat.out, (arg(flat, "tensors"), arg(flat, "dim")), {"out": mine})
        filled.meta.update(flat.meta, val=val(mine))
        gather.args = (filled, *gather.args[1:])
        gather.kwargs = {**gather.kwargs, "out": into}
        graph.erase_node(flat)
        graph.erase_node(buffer)
        changed = True
    return _recompiled(gm, changed)


# A collective in flight reads its input until its wait. Inductor knows it of the out-of-place
# collectives (their wait reads their input: its "out-of-place collective safety"), not of the
# _out form that gathers_into_buffers emits, whose input it takes for dead once the call
# returns: it handed that storage to the next buffer of the same size while gloo was still
# sending from it (a ViT's patch-embedding weight, overwritten by the pixels' layout copy: the
# loss off by 1e-2 from the first step, by a different amount each run). Holding the graph's
# input node is not enough: Inductor may send a layout copy of it (there, a channels-last
# weight made contiguous), a buffer of its own that the graph cannot name. So the input is
# an opaque op's output, whose layout Inductor keeps: a copy-in or pad already, else a copy.
_OPAQUE_INPUTS = (torch.ops.autoshard.copy_in.default, torch.ops.autoshard.pad_shard.default, SEND_BUFFER)


def gather_inputs_held(gm: fx.GraphModule, needed: Callable[[str], bool] = on_gloo) -> fx.GraphModule:
    """Keep each gather-into-buffer's input alive until its wait, for compilers that plan buffers.

    Guarantees: every ``all_gather_into_tensor_out(x, ..., out=buffer)`` over a ``needed`` group
    sends from the output of an opaque op (``x`` itself when it is a copy-in or a pad, else
    ``autoshard.send_buffer(x)``, a contiguous copy, placed right before the gather), and after
    its wait ``autoshard.hold(wait, [that input])`` reads it: a compiler that plans its own
    buffers (Inductor) neither frees nor reuses the storage the gather sends from before the
    gather is done. ``hold`` does nothing at run time; order, numerics and collectives are
    unchanged. Run after :func:`gathers_into_buffers` and after scheduling (the ops are no
    compute to place). The pass is idempotent.

        before:  x -> gather(x, out=empty) -> ... y = reuse(x's storage) ... -> wait -> uses
        after:   x -> send_buffer(x) -> gather(copy, out=empty) -> ... -> wait -> hold(wait, [copy]) -> uses
    """
    graph = gm.graph
    held = {arg(n, "done") for n in graph.find_nodes(op="call_function", target=HOLD)}
    changed = False
    for gather in collectives(graph, c10d.all_gather_into_tensor_out.default):
        wait = wait_of(gather)
        if not needed(arg(gather, "group_name")) or wait in held:
            continue
        sent = arg(gather, "input")
        if sent.target not in _OPAQUE_INPUTS:
            with graph.inserting_before(gather):
                copy = call(graph, SEND_BUFFER, sent)
            gather.replace_input_with(sent, copy)
            sent = copy
        with graph.inserting_after(wait):
            graph.call_function(HOLD, (wait, [sent]))
        changed = True
    return _recompiled(gm, changed)


# gloo has no reduce-scatter of its own: it all-reduces a clone of the input, then copies this
# rank's chunk out, which moves twice a reduce-scatter's bytes. An all-to-all moves exactly
# them: every rank receives the others' copies of its chunk and adds them up itself, in about
# 0.6-0.7x the time (docs/design.md, "Where the cpu profile's figures come from"). It holds
# the input and what it receives while in flight, as gloo's clone did.

_COMBINE = {"sum": aten.sum.dim_IntList, "avg": aten.mean.dim}


def reductions_by_exchange(gm: fx.GraphModule, needed: Callable[[str], bool] = on_gloo) -> fx.GraphModule:
    """Run each reduce-scatter over a ``needed`` group as an all-to-all and a local sum.

    Guarantees: ``reduce_scatter_tensor(flat, op, n, group)`` -> ``wait`` with ``op`` "sum" or
    "avg" becomes ``all_to_all_single(flat, n chunks)`` -> ``wait`` -> ``view(n, chunk)`` ->
    ``sum`` / ``mean`` over the ranks, which replaces the old wait's uses: every rank's chunk
    reduced over the group, as before, at the same places. Every rank's graph stays the same
    (no rank offsets). Other reductions are untouched; the pass is idempotent.

        before:  cat -> reduce_scatter(cat) -> wait -> slices
        after:   cat -> all_to_all(cat) -> wait -> view(n, ...) -> mean(0) -> slices
    """
    graph = gm.graph
    changed = False
    for reduce in collectives(graph, c10d.reduce_scatter_tensor.default):
        flat, group, op = arg(reduce, "input"), arg(reduce, "group_name"), arg(reduce, "reduce_op")
        if op not in _COMBINE or not needed(group):
            continue
        wait, chunk, n = wait_of(reduce), val(reduce), arg(reduce, "group_size")
        rows = [chunk.shape[0]] * n
        with graph.inserting_before(reduce):
            exchange = call(graph, c10d.all_to_all_single.default, flat, rows, rows, group)
        exchange.meta.update({k: v for k, v in reduce.meta.items() if k != "val"})
        wait.replace_input_with(reduce, exchange)
        wait.meta["val"] = val(exchange)
        with graph.inserting_after(wait):
            stacked = call(graph, aten.view.default, wait, [n, *chunk.shape])
        with graph.inserting_after(stacked):
            own = call(graph, _COMBINE[op], stacked, [0])
        wait.replace_all_uses_with(own, delete_user_cb=lambda user: user is not stacked)
        graph.erase_node(reduce)
        changed = True
    return _recompiled(gm, changed)


# gloo's worker thread holds a collective's tensors (a gather's input, the views of its output)
# until it drops the finished operation, sometimes well after the wait has returned: then
# freeing them is its business, and the process's peak moved by tens of MiB from run to run
# for one plan (docs/design.md, "Where the cpu profile's figures come from"). Resizing a storage to 0 frees its memory
# whoever still references it, so the graph frees what it allocated at a known point.


_HELD_BY_GLOO = (c10d.all_reduce_.default, c10d.all_to_all_single.default)


def free_collective_buffers(gm: fx.GraphModule, needed: Callable[[str], bool] = on_gloo) -> fx.GraphModule:
    """Free each storage an all-gather, an all-to-all or an in-place all-reduce over a
    ``needed`` group reads or writes, and the graph allocated, right after its last use.

    Guarantees: for every such storage (allocated by a node of this graph, no alias of it
    returned by the graph), a ``resize_storage_bytes_(buffer, 0)`` follows the last node that
    uses it through any alias, and the wait of every such collective that uses it: the bytes are
    gone there, whoever still holds the tensor. Placeholders (parameter shards, saved values)
    and outputs are never freed. Order and numerics are unchanged. For graphs run op by op
    (aot_eager): Inductor plans and reuses its own buffers.

        before:  cat -> gather(cat, out=empty) -> wait -> copy-outs
        after:   cat -> gather(cat, out=empty) -> wait -> copy-outs -> free(cat) free(empty)
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    root = storage_roots(graph)
    returned = {root[a] for a in graph.output_node().all_input_nodes}
    last: dict[fx.Node, fx.Node] = {}  # storage -> the node after which it may go
    for n in graph.nodes:
        for a in n.all_input_nodes:
            r = root[a]
            if r not in last or order[n] > order[last[r]]:
                last[r] = n
    freed: dict[fx.Node, fx.Node] = {}
    for collective in graph.nodes:
        # Gathers, exchanges and in-place reductions: gloo holds their tensors. It reduces a
        # clone of an out-of-place reduction's input, which the graph already frees at the issue.
        if collective.op != "call_function" or not (
            collective_kind(collective) == "all_gather" or collective.target in _HELD_BY_GLOO
        ):
            continue
        if not needed(arg(collective, "group_name")):
            continue
        received = [collective] if is_exchange(collective) else []  # an all-to-all's output is its own
        for a in collective.all_input_nodes + received:
            r = root[a]
            if r.target not in _ALLOCATES or r in returned or r in freed:
                continue  # not a storage this graph allocated, returned, or done already
            after = max((last[r], wait_of(collective)), key=order.__getitem__)
            freed[r] = after
    for buffer, after in freed.items():
        with graph.inserting_after(after):
            graph.call_function(resize_storage_bytes_, (buffer, 0))
    return _recompiled(gm, bool(freed))
