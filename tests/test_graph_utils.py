"""graph_utils.call: the fake value of an inserted node is what the fake mode would compute;
graph_utils.Replacer: the output rewritten once per pass.

The passes insert thousands of nodes, so ``call`` takes a view's value from its meta kernel on
the input's own storage and a new tensor's from its meta kernel, run once per signature
(passes/fake_values.py), not from the fake mode's dispatch; these tests compare both against
that dispatch.
"""
from __future__ import annotations

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from autoshard._compat import FakeTensor, FakeTensorMode
from autoshard.passes.graph_utils import COPY_OUT, Replacer, call

aten = torch.ops.aten


def _graph(*shapes: tuple[int, ...]) -> tuple[fx.Graph, list[fx.Node], FakeTensorMode]:
    mode = FakeTensorMode()
    graph = fx.Graph()
    nodes = []
    for i, shape in enumerate(shapes):
        node = graph.placeholder(f"x{i}")
        with mode:
            node.meta["val"] = torch.empty(shape)
        nodes.append(node)
    return graph, nodes, mode


def _same_metadata(found: torch.Tensor, expected: torch.Tensor) -> None:
    assert isinstance(found, FakeTensor) and found.fake_mode is expected.fake_mode
    assert (found.shape, found.stride(), found.dtype, found.device, found.storage_offset()) == \
        (expected.shape, expected.stride(), expected.dtype, expected.device, expected.storage_offset())


def test_views_share_their_input_storage_as_fake_views_do():
    graph, (x,), mode = _graph((8, 6))
    cases = [(aten.slice.Tensor, (x, 1, 2, 5)), (aten.view.default, (x, [48])), (aten.t.default, (x,)),
             (aten.narrow.default, (x, 0, 4, 4))]
    for target, args in cases:
        node = call(graph, target, *args)
        with mode:
            expected = target(x.meta["val"], *args[1:])
        _same_metadata(node.meta["val"], expected)
        assert StorageWeakRef(node.meta["val"].untyped_storage()) == StorageWeakRef(x.meta["val"].untyped_storage()), target


def test_new_tensors_have_the_fake_modes_metadata_and_their_own_storage():
    graph, (x, y), mode = _graph((8, 6), (4, 6))
    sliced = call(graph, aten.slice.Tensor, x, 1, 0, 3)  # not contiguous: the clone's strides follow
    cases = [(aten.clone.default, (sliced,)), (aten.cat.default, ([x, y],)), (aten.constant_pad_nd.default, (y, [0, 0, 0, 4])),
             (aten._to_copy.default, (x,))]
    for target, args in cases:
        node = call(graph, target, *args)
        fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
        with mode:
            expected = target(*fake_args)
        _same_metadata(node.meta["val"], expected)
        assert all(StorageWeakRef(node.meta["val"].untyped_storage()) != StorageWeakRef(n.meta["val"].untyped_storage())
                   for n in (x, y)), target


def test_a_remembered_layout_is_a_new_tensor_each_time_and_tells_arguments_apart():
    graph, (x, y), mode = _graph((8, 6), (4, 6))
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    cases = [
        (aten.cat.default, ([x, y],)), (aten.cat.default, ([y, y], 1)),
        (torch.ops.prims.convert_element_type.default, (x, torch.bfloat16)),
        (torch.ops.prims.convert_element_type.default, (x, torch.float16)),
        (aten.constant_pad_nd.default, (y, [0, 0, 0, 4], 0.0)), (aten.constant_pad_nd.default, (y, [0, 0, 0, 2], 0.0)),
        (gather, (x, 4, "0")), (gather, (x, 2, "0")), (COPY_OUT, (x, 2, [6, 18])), (COPY_OUT, (x, 4, [6, 6])),
    ]
    for target, args in cases + cases:  # the second round takes remembered layouts
        first, second = call(graph, target, *args), call(graph, target, *args)
        fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
        with mode:
            expected = target(*fake_args)
        for found in (first.meta["val"], second.meta["val"]):
            for f, e in zip(*(v if isinstance(v, list) else [v] for v in (found, expected)), strict=True):
                _same_metadata(f, e)
        outputs = [t for n in (first, second, x, y) for t in (n.meta["val"] if isinstance(n.meta["val"], list) else [n.meta["val"]])]
        storages = {StorageWeakRef(t.untyped_storage()) for t in outputs}
        assert len(storages) == len(outputs), f"{target}: a result shares storage with another"


def test_replacer_rewrites_the_output_once_and_erases_what_it_replaced():
    """Drawn (``a``, ``b`` read by the output and by ``mul``; ``c`` by the output only)::

        a = x + 1; b = a * 2; c = relu(b); mul = b * b     output(a, c, mul, b)
        replace a -> a2, b -> b2, then b2 -> b3 (a chain), c -> c2

    Uses other than the output's change at once; the output's, followed through the chain,
    and the erasures happen in finish(): until then a node only the output reads stays."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.add, (x, 1))
    b = graph.call_function(torch.mul, (a, 2))
    c = graph.call_function(torch.relu, (b,))
    mul = graph.call_function(torch.mul, (b, b))
    graph.output((a, c, mul, b))
    with graph.inserting_before(a):  # the new nodes read only x
        a2 = graph.call_function(torch.sub, (x, 1))
        b2 = graph.call_function(torch.neg, (x,))
        b3 = graph.call_function(torch.abs, (x,))
        c2 = graph.call_function(torch.sigmoid, (x,))

    replacer = Replacer(graph)
    replacer.replace(a, a2)
    assert b.args == (a2, 2) and a in graph.nodes  # the output still reads a
    replacer.replace(b, b2)
    assert c.args == (b2,) and mul.args == (b2, b2)
    replacer.replace(b2, b3)  # a replacement replaced again
    replacer.replace(c, c2)
    assert graph.output_node().args == ((a, c, mul, b),)
    replacer.finish()
    assert graph.output_node().args == ((a2, c2, mul, b3),)
    assert mul.args == (b3, b3)
    assert not {a, b, b2, c} & set(graph.nodes)
    graph.lint()
    gm = fx.GraphModule(torch.nn.Module(), graph)
    t = torch.tensor([-2.0, 3.0])
    out = gm(t)
    torch.testing.assert_close(out[0], t - 1)
    torch.testing.assert_close(out[1], torch.sigmoid(t))
    torch.testing.assert_close(out[2], t.abs() * t.abs())
    torch.testing.assert_close(out[3], t.abs())


def test_replacer_refuses_to_erase_a_node_still_in_use():
    """``erase`` of a node another node still reads is deferred to finish(), which must fail
    rather than leave the node in the graph unnoticed."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.neg, (x,))
    b = graph.call_function(torch.abs, (a,))
    graph.output((b,))
    replacer = Replacer(graph)
    replacer.erase(a)  # b still reads it: nothing the output waits for will free it
    assert a in graph.nodes
    try:
        replacer.finish()
    except RuntimeError as e:
        assert "users" in str(e)
    else:
        raise AssertionError("finish() left a node in use in the graph without an error")
