"""Big-model init: build on the meta device, shard, then allocate and initialise only this
rank's shards, as FSDP2 users do::

    with torch.device("meta"):
        model = GPT(config)          # no memory
    autoshard.shard(model)           # meta shards: still no memory
    autoshard.materialize(model, "cuda")   # this rank's shards, initialised

No rank ever holds the whole model: ``materialize`` allocates the shards (``to_empty``) and
runs the model's own init on them. The init sees each parameter as its DTensor (global
shape, so fan-in based inits compute the right bounds), and a random fill of a DTensor
(``uniform_``, ``normal_``, ...) draws the whole parameter's values from this process's
generator, one parameter at a time, and keeps this rank's rows. With the same seed, every
rank's shards therefore equal the slices of the same model built in one process and
initialised in the same order, on any device (DTensor's own random ops keep ranks consistent
only on CUDA-like devices, and with values of their own).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from autoshard.runtime.batch_shares import refill_weight
from autoshard.runtime.errors import UsageError
from autoshard.runtime.layout import local_chunk
from autoshard.runtime.shard import ShardedModule, parameters_as_shards

# In-place random fills of Tensor; each draws from the default generator.
_RANDOM_FILLS = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_"}


class _FillLikeOneProcess(TorchFunctionMode):
    """``torch.nn.init`` functions, random fills and copies of a whole plain tensor into a
    DTensor act on a full temporary, of which this rank keeps its rows.

    ``nn.init`` functions are taken whole: called on a DTensor they run their inner fills with
    this mode off (a mode is off inside its own handler), so the inner fills cannot be caught.
    """

    def __init__(self, rows: dict[int, tuple[int, ...]]) -> None:
        super().__init__()
        self.rows = rows  # id of a parameter cut by state shares -> every rank's rows

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # nn.init functions dispatch with the tensor as a keyword; methods take it first.
        if args and isinstance(args[0], DTensor):
            target, rest = args[0], args[1:]
            call = lambda t: func(t, *rest, **kwargs)  # noqa: E731
        elif isinstance(kwargs.get("tensor"), DTensor):
            target, rest = kwargs["tensor"], ()
            call = lambda t: func(**{**kwargs, "tensor": t})  # noqa: E731
        else:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        copies = name == "copy_" and _plain_full(target, rest[0] if rest else None)
        if not (copies or name in _RANDOM_FILLS or getattr(func, "__module__", None) == "torch.nn.init"):
            return func(*args, **kwargs)
        local = target.to_local()
        with torch.no_grad():
            if copies:
                full = rest[0].to(device=local.device, dtype=local.dtype)
            else:  # one full parameter, transient: the same draws as in one process
                full = torch.empty(target.shape, dtype=local.dtype, device=local.device)
                call(full)
            local.copy_(local_chunk(full, target.device_mesh, target.placements, self.rows.get(id(target), ())))
        return target


def _plain_full(target: DTensor, source: Any) -> bool:
    return isinstance(source, torch.Tensor) and not isinstance(source, DTensor) and source.shape == target.shape


def reset_parameters(module: nn.Module) -> None:
    """The default init: every submodule's ``reset_parameters()``, in ``modules()`` order
    (the order a model's constructor usually runs them)."""
    for m in module.modules():
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()


@contextmanager
def shards_in_place(module: nn.Module) -> Iterator[nn.Module]:
    """Inside, ``module.weight`` and friends are the sharded DTensor parameters themselves
    (not the gathered copies a forward reads), and random fills into them draw as one process
    would: write an init that works on shards."""
    rows = {id(mod._parameters[name]): spec.rows for mod in module.modules()
            for name, spec in getattr(mod, "_autoshard_specs", {}).items() if spec.rows}
    with parameters_as_shards(), _FillLikeOneProcess(rows):
        yield module


def materialize(module: nn.Module, device: torch.device | str, init: Callable[[nn.Module], None] | None = reset_parameters) -> nn.Module:
    """Allocate a sharded module's parameters and buffers on ``device`` (``to_empty``: each
    rank only its shards) and initialise them with ``init(module)`` inside
    :func:`shards_in_place`; return the module.

    ``init``: the model's own init (default: each submodule's ``reset_parameters()``; pass
    e.g. ``lambda m: m.init_weights()``, or None to leave the memory uninitialised). Buffers
    are allocated uninitialised too: an init that leaves a buffer (a RoPE table, a mask) must
    fill it, as with FSDP2. Build the optimizer after this.
    """
    if not isinstance(module, ShardedModule):
        raise UsageError(
            f"autoshard.materialize: {type(module).__name__} is not sharded; call autoshard.shard(module) first "
            "(build it under torch.device('meta'), shard it, then materialize it)."
        )
    module.to_empty(device=device)
    refill_weight(module)  # autoshard's own buffer: the batch shares' gradient weight
    if init is not None:
        with shards_in_place(module):
            init(module)
    return module
