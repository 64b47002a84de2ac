"""Compile as a large world in one process with the fake process group, and capture the
graphs the backend produced at each stage.

:func:`sharded_step` (and :func:`compile_step`, its one-shot form) is the one place the tests
build a model, shard it, compile it under a fake world and keep the graphs."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence, Union

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import autoshard
from autoshard._compat import fake_process_group, fake_tensor_mode
from autoshard.compiler.dump import recording

from models import batch, build


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    fake_process_group(rank, world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _ByStage:
    """``graphs["forward"]``: the copies of that stage recorded so far, in compile order."""

    def __init__(self, compiled: list[dict[str, fx.GraphModule]]) -> None:
        self.compiled = compiled

    def __getitem__(self, stage: str) -> list[fx.GraphModule]:
        return [stages[stage] for stages in self.compiled if stage in stages]


@contextlib.contextmanager
def captured_graphs() -> Iterator[_ByStage]:
    """The graphs the backend compiles meanwhile, by stage (``forward``, ``backward``, ...)."""
    with recording() as compiled:
        yield _ByStage(compiled)


def count(gm: fx.GraphModule, op_name: str) -> int:
    """Number of calls to an op whose name contains ``op_name`` (e.g. "all_gather_into_tensor")."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and op_name in str(n.target))


@dataclasses.dataclass
class Step:
    """What one compiled step left behind."""

    model: nn.Module  # the sharded model
    graphs: _ByStage  # every stage of every graph compiled, by stage name
    mesh: DeviceMesh | None  # the mesh given to shard (None: shard's default)
    result: Any  # what ``run`` returned

    def only(self, stage: str) -> fx.GraphModule:
        """The one graph of ``stage``; fails when the model compiled to several (graph breaks)."""
        (gm,) = self.graphs[stage]
        return gm

    @property
    def forward(self) -> fx.GraphModule:
        return self.only("forward")

    @property
    def backward(self) -> fx.GraphModule:
        return self.only("backward")


def first_example(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of step 0's batch of ``models.MODELS[name]``: graphs depend on shapes only."""
    x, y = batch(name, 0)
    return x[:1], y[:1]


def same_tokens(make: Callable[[], torch.Tensor]) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Inputs for a language model: the token ids ``make()`` returns as inputs and as targets
    (the graphs depend on shapes only)."""
    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        idx = make()
        return idx, idx

    return inputs


Factory = Union[str, Callable[[], nn.Module]]


@contextlib.contextmanager
def sharded_step(
    model: Factory,
    inputs: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
    *,
    world_size: int = 8,
    rank: int = 0,
    mesh: tuple[int, ...] | None = None,
    options: dict | None = None,
    train: bool = True,
    sync: bool = True,
    fake: bool = False,
    run: Callable[[Callable[[], Any]], Any] | None = None,
    **shard_kwargs: Any,
) -> Iterator[Step]:
    """Build, shard and compile a model at ``world_size`` (fake process group, this process as
    ``rank``), run one step on ``inputs`` and yield what it left; the fake world stays up
    until the block ends (passes that resolve group names need it).

    ``model``: a name in ``models.MODELS`` (then ``inputs`` defaults to
    :func:`first_example`) or a factory. ``inputs``: a tuple, or a callable making one (called
    after the factory, inside the world and, with ``fake``, inside a fake tensor mode).
    ``mesh``: a mesh shape to shard over. ``options``: backend options over
    ``{"compiler": "aot_eager"}``. ``train``: backpropagate the output, else run under
    ``no_grad`` (the inference graph). ``sync``: ``set_requires_gradient_sync``. ``fake``:
    build the model and inputs as fake tensors (no memory). ``run``: wraps the step (a
    no-argument callable), e.g. ``run_and_get_code``; its result is ``Step.result``.
    ``shard_kwargs`` go to ``autoshard.shard``.
    """
    if isinstance(model, str):
        name, model = model, (lambda: build(name))
        inputs = inputs if inputs is not None else (lambda: first_example(name))
    assert inputs is not None, "a factory needs inputs"
    torch._dynamo.reset()  # a cached compile would record no graphs
    with fake_world(world_size, rank), captured_graphs() as graphs:
        device_mesh = init_device_mesh("cpu", mesh) if mesh is not None else None  # needs real tensors
        with fake_tensor_mode() if fake else contextlib.nullcontext():
            sharded = autoshard.shard(model(), device_mesh, **shard_kwargs)
            if not sync:
                sharded.set_requires_gradient_sync(False)
            args = inputs() if callable(inputs) else inputs
            compiled = torch.compile(sharded, backend="autoshard", options={"compiler": "aot_eager", **(options or {})})

            def step() -> None:
                if train:
                    compiled(*args).backward()
                else:
                    with torch.no_grad():
                        compiled(*args)

            result = run(step) if run is not None else step()
        yield Step(sharded, graphs, device_mesh, result)


def compile_step(model: Factory, inputs: Any = None, **kwargs: Any) -> Step:
    """:func:`sharded_step` when the graphs are all the test needs (the fake world is gone)."""
    with sharded_step(model, inputs, **kwargs) as step:
        return step
