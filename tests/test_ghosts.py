"""Capture: traced parameter reads return ghosts, which only autoshard's backend receives; it
gathers them with one op, which the joint graph splits back into one op per parameter."""
from __future__ import annotations

import functools
import operator

import torch
from torch import fx, nn

import autoshard
from autoshard.compiler.dump import recording
from autoshard.passes import unbatch_annotations
from autoshard.passes.graph_utils import arg, is_op
from autoshard.runtime import batched, leaves, ops

from fake_pg import compile_step, count, fake_world
from models import batch, build
from pass_graphs import events

annotations = torch.ops.autoshard


def test_one_gather_for_the_trainable_parameters_and_one_for_the_frozen():
    step = compile_step("frozen")
    params = list(step.model.parameters())
    captured = step.only("captured")
    batches = [n for n in captured.graph.nodes if is_op(n, annotations.unshard_all)]
    assert sorted(len(arg(b, "tensors")) for b in batches) == sorted([sum(p.requires_grad for p in params),
                                                                   sum(not p.requires_grad for p in params)])
    assert count(captured, "autoshard.unshard.") == 0  # no op per parameter use in Dynamo's graph
    # The joint graph has one op per parameter again; only the trainable ones are reduced.
    joint = step.only("joint")
    assert count(joint, "autoshard.unshard_all") == count(joint, "autoshard.reduce_all") == 0
    assert count(joint, "autoshard.unshard.") == len(params)
    assert count(joint, "autoshard.reduce_grad") == sum(p.requires_grad for p in params)


def test_another_backend_computes_with_the_real_parameters():
    """A sharded model compiled with a backend other than autoshard's gets one op per parameter
    use (real collectives), never a ghost's zeros."""
    with fake_world(1):
        model = autoshard.shard(build("mlp"))
        x = batch("mlp", 0)
        expected = model(*x)
        inputs = []

        def backend(gm, example_inputs):
            inputs.extend(example_inputs)
            return gm.forward

        got = torch.compile(model, backend=backend)(*x)
        torch._dynamo.reset()
    assert torch.equal(got, expected)
    assert inputs and not any(leaves.ghost_leaves(x) is not None for x in inputs)


def test_ghosts_follow_requires_grad_and_hold_no_memory():
    with fake_world(2):
        linear = autoshard.shard(nn.Linear(2, 4))
        found = getattr(linear, leaves.LEAVES)["weight"]
        assert found.ghost.shape == (4, 2) and found.ghost.stride() == (0, 0) and found.ghost.requires_grad
        assert found.ghost.isnan().all()  # a graph computing with a ghost itself would show it
        linear._parameters["weight"].requires_grad_(False)
        leaves.synced(found)
        assert not found.ghost.requires_grad and not found.leaf.requires_grad
        assert leaves.ghost_leaves(found.ghost) is found and leaves.ghost_leaves(found.leaf) is None


def test_reads_are_ghosts_only_while_gradients_sync_and_switching_back_recompiles_nothing():
    """A traced read returns the ghost for autoshard's backend with synchronisation on; off,
    the annotation op per use (its gradient goes to a sink). Each setting compiles once."""
    from autoshard.compiler.backend import autoshard_backend

    with fake_world(2):
        model = autoshard.shard(build("mlp"))
        x = batch("mlp", 0)
        ghost_inputs: list[int] = []

        @functools.wraps(autoshard_backend)  # keeps the mark that makes reads ghosts
        def backend(gm, example_inputs):
            ghost_inputs.append(sum(leaves.ghost_leaves(t) is not None for t in example_inputs))
            return autoshard_backend(gm, example_inputs, options={"compiler": "aot_eager"})

        compiled = torch.compile(model, backend=backend)
        for sync in (True, False, True, False):
            model.set_requires_gradient_sync(sync)
            compiled(*x).sum().backward()
        torch._dynamo.reset()
    params = len(list(model.parameters()))
    assert ghost_inputs == [params, 0]  # two graphs: every parameter a ghost, then none


def _traced_step() -> fx.GraphModule:
    """A joint graph as AOT autograd traces the batched ops: two parameters of two rows per
    rank (world 2), the first used by the second matmul, the second by the first."""
    from torch.fx.experimental.proxy_tensor import make_fx

    calls = [(ops.UNSHARD, ("g", 2, 4, True, name, None, None, None, "", 1)) for name in ("a", "b")]
    key = batched.key_for(calls)

    def step(a, b, x):
        full_a, full_b = batched.unshard_all([a, b], key)
        y = (x @ full_b.t()).relu() @ full_a.t()
        return torch.autograd.grad(y.sum(), [a, b])

    shards = [torch.randn(2, 4, requires_grad=True) for _ in range(2)]
    return make_fx(step, tracing_mode="fake")(*shards, torch.randn(3, 4))


def test_unbatch_puts_each_gather_before_its_first_use_and_each_reduce_after_its_gradient(drawing):
    """b is read first (by the first matmul), a by the second; the gradient of a is complete
    before b's.

    before:  un_all mm mm mm mm mm rg_all
    after:   un(b) mm un(a) mm mm mm rg(a) mm rg(b)
    """
    gm = _traced_step()
    assert events(gm) == drawing("before")
    unbatch_annotations(gm)
    assert events(gm) == drawing("after")
    assert not any(n.target is operator.getitem and is_op(n.args[0], annotations.unshard_all) for n in gm.graph.nodes)
    unbatch_annotations(gm)  # idempotent
    assert events(gm) == drawing("after")


def _gathers_run(step) -> int:
    """All-gathers a call of ``step`` (forward and backward) runs."""
    with torch.profiler.profile() as prof:
        step()
    return sum(e.count for e in prof.key_averages() if "all_gather" in e.key)


def test_two_models_of_one_class_sharded_differently_each_run_their_own_graph():
    """A traced read returns a ghost, whose spec Dynamo does not see; the root's layout key
    (leaves.layout_key) is what it guards on. Without it a second model of the class, reaching
    the frame compiled for the first, ran the first's graph: its gathers, its groups, its dtypes."""
    with fake_world(4):
        torch.manual_seed(0)
        models = {"reshard": autoshard.shard(build("mlp"), reshard_after_forward=True),
                  "keep": autoshard.shard(build("mlp"), reshard_after_forward=False),
                  "reshard_too": autoshard.shard(build("mlp"), reshard_after_forward=True)}
        assert leaves.layout_key(models["reshard"]) == leaves.layout_key(models["reshard_too"]) != leaves.layout_key(models["keep"])
        x = batch("mlp", 0)
        compiled = {name: torch.compile(m, backend="autoshard", options={"compiler": "aot_eager"}) for name, m in models.items()}
        for name in ("reshard", "keep", "reshard_too"):  # each compiles in its first call
            compiled[name](*x).backward()
        with recording() as graphs:
            gathers = {name: _gathers_run(lambda: compiled[name](*x).backward()) for name in compiled}
        assert not graphs  # nothing compiled again
        assert gathers["reshard"] == gathers["reshard_too"] > gathers["keep"] > 0  # gathered again in backward
