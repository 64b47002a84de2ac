"""The plain-tensor leaves the forward reads instead of DTensor parameters: one storage with the
shard, gradients that are the DTensor parameter's ``.grad``, rebuilt when shards move."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import autoshard
from autoshard.runtime.leaves import LEAVES

from fake_pg import compile_step, fake_world
from models import build


@pytest.fixture
def linear():
    with fake_world(2):
        torch.manual_seed(0)
        yield autoshard.shard(nn.Linear(2, 4))


def _leaves(module: nn.Module, name: str = "weight"):
    return getattr(module, LEAVES)[name]


def _backward(leaf: torch.Tensor, scale: float) -> None:
    (leaf * scale).sum().backward()


def test_a_leaf_views_the_shard(linear):
    found = _leaves(linear)
    local = linear._parameters["weight"].to_local()
    assert not isinstance(found.leaf, DTensor) and found.leaf.requires_grad
    assert found.leaf.data_ptr() == local.data_ptr()  # no copy
    with torch.no_grad():
        linear._parameters["weight"].mul_(0)  # as an optimizer step writes the shard
    assert found.leaf.abs().sum() == 0


def test_the_leaf_gradient_is_the_parameter_gradient(linear):
    param, leaf = linear._parameters["weight"], _leaves(linear).leaf
    _backward(leaf, 2.0)
    assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements
    assert torch.equal(param.grad.to_local(), torch.full_like(leaf, 2.0))
    grad = param.grad
    _backward(leaf, 3.0)  # accumulates in place, into the same tensor
    assert param.grad is grad and torch.equal(grad.to_local(), torch.full_like(leaf, 5.0))


def test_zero_grad_and_an_assigned_gradient_are_respected(linear):
    param, leaf = linear._parameters["weight"], _leaves(linear).leaf
    _backward(leaf, 2.0)
    param.grad = None  # zero_grad(set_to_none=True)
    _backward(leaf, 3.0)
    assert torch.equal(param.grad.to_local(), torch.full_like(leaf, 3.0))
    assigned = DTensor.from_local(torch.full_like(leaf, 10.0), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    param.grad = assigned
    _backward(leaf, 1.0)
    assert param.grad is assigned and torch.equal(assigned.to_local(), torch.full_like(leaf, 11.0))


def test_moving_the_module_rebuilds_its_leaves(linear):
    before = _leaves(linear)
    linear.to(torch.float64)
    after = _leaves(linear)
    assert after.leaf is not before.leaf and after.leaf.dtype == torch.float64
    assert after.leaf.data_ptr() == linear._parameters["weight"].to_local().data_ptr()


def test_tied_parameters_share_their_leaves():
    with fake_world(2):
        model = autoshard.shard(build("gpt"))
        assert _leaves(model.head) is _leaves(model.wte)


def test_the_captured_graph_has_no_dtensor_input():
    step = compile_step("gpt")
    placeholders = [n for n in step.only("captured").graph.nodes if n.op == "placeholder"]
    assert placeholders and not any(isinstance(n.meta.get("example_value"), DTensor) for n in placeholders)


def test_a_deep_copy_reads_its_own_shards_and_trainability():
    """A copy (an EMA model, say) checks and syncs its own leaves, not the original's."""
    import copy

    with fake_world(1):
        torch.manual_seed(0)
        model = autoshard.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
        twin = copy.deepcopy(model)
        x = torch.randn(3, 4)
        assert torch.equal(model(x), twin(x))
        for param in twin.parameters():
            param.requires_grad_(False)
        with torch.no_grad():
            for param in twin.parameters():
                param.zero_()
        assert twin(x).abs().sum() == 0 and model(x).abs().sum() > 0  # the copy's shards, not the original's
        assert not _leaves(twin[0]).leaf.requires_grad and _leaves(model[0]).leaf.requires_grad


def test_a_compiled_copy_frozen_before_its_first_call_is_traced_frozen():
    """As Dynamo traces a sharded root's forward, it syncs every leaf under it (and only under
    it): a copy frozen before its first compiled call trains as frozen, the original as it was."""
    import copy

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with fake_world(1):
        torch.manual_seed(0)
        model = autoshard.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
        twin = copy.deepcopy(model)
        for param in twin[0].parameters():
            param.requires_grad_(False)
        x = torch.randn(3, 4)
        torch.compile(twin, backend=backend)(x).sum().backward()
        assert len(graphs) == 1
        assert twin[0]._parameters["weight"].grad is None and twin[1]._parameters["weight"].grad is not None
        assert not _leaves(twin[0]).leaf.requires_grad and _leaves(model[0]).leaf.requires_grad
        torch._dynamo.reset()
