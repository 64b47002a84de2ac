"""What a sharded module is, apart from how :func:`autoshard.shard` makes one: the spec each
sharded parameter is annotated with (:class:`ParamSpec`), the :class:`ShardedModule` mixin and
the per-class subclasses whose parameter names are properties returning the full parameter
through its annotation op, and :func:`parameters_as_shards`, under which those properties
return the shards themselves. :mod:`autoshard.runtime.shard` builds on this and re-exports it.
"""
from __future__ import annotations

import copy
import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from autoshard.runtime import grad_scale, grad_sync, leaves, ops
from autoshard.runtime.tensor_parallel import as_tensor_parallel

_SHARDED = "_autoshard_root"  # set on every module passed to shard()


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` was passed to :func:`shard` (as the root or as a block)."""
    return bool(getattr(module, _SHARDED, False))


@dataclass(frozen=True)
class ParamSpec:
    """What a parameter's annotation needs; plain constants so Dynamo guards on them cheaply."""

    group_name: str  # the group the parameter is sharded over (replicated: averaged over)
    world_size: int
    dim0: int  # full rows; -1 for a replicated parameter (0-d, or strategy "replicate")
    reshard: bool | None  # None: all but what the backward needs first (passes/lower.py)
    name: str  # fully qualified, relative to the outermost module passed to shard()
    param_dtype: torch.dtype | None = None  # gathered and computed in; None: its own
    reduce_dtype: torch.dtype | None = None  # gradients reduced in; None: the gradient's
    replica_group: str = ""  # hybrid: gradients are then averaged over this group too
    replicas: int = 1
    # State shares: every rank's rows, the same on every rank (sum: dim0); () for the even
    # Shard(0) layout (autoshard/runtime/state_shares.py).
    rows: tuple[int, ...] = ()
    # Compression: elements per scale of an int8 gather (autoshard/runtime/quantize.py); 0: none.
    quant_block: int = 0
    # Compression: elements per scale of an int8 gradient reduction (all-to-all); 0: none.
    reduce_block: int = 0
    # Hierarchical backward gathers (reshard_after_forward=G, autoshard/runtime/hpz.py): the
    # group of this rank's node and its size G; "" and 0: none.
    node_group: str = ""
    node_size: int = 0
    # Compression: how a quantized gather encodes its values, "int8" or "fp8" (float8 e4m3 bytes).
    quant_codec: str = "int8"
    # Tensor parallelism under it (autoshard/runtime/tensor_parallel.py): the gathered tp-local
    # tensor is read as this DTensor layout; None: the gathered tensor is the parameter.
    tp: Any = None
    # The annotation op and its arguments before and after ``sink``, built once: a parameter
    # use then loads an op and two tuples of constants, which Dynamo traces much faster than
    # ten attributes.
    op: Callable[..., torch.Tensor] = field(init=False, compare=False, repr=False)
    head: tuple = field(init=False, compare=False, repr=False)
    tail: tuple = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        shape = (self.world_size,) if self.dim0 < 0 else (self.world_size, self.dim0, self.reshard)
        # The ops' overloads themselves: calling their Python wrappers costs Dynamo a frame each.
        object.__setattr__(self, "op", ops.REPLICATE if self.dim0 < 0 else ops.UNSHARD)
        object.__setattr__(self, "head", (self.group_name, *shape, self.name))
        # Left out at their defaults (even rows, no compression, no node group, int8): the op's
        # defaults, the graphs unchanged.
        codec = None if self.quant_codec == "int8" else self.quant_codec
        rows = [self.rows or None, self.quant_block, self.reduce_block, self.node_group, self.node_size, codec]
        while rows and rows[-1] in (None, 0, ""):
            rows.pop()
        object.__setattr__(self, "tail", (self.param_dtype, self.reduce_dtype, self.replica_group, self.replicas, *rows))


class ShardedModule:
    """Mixed into the class of every module ``shard`` touches (like FSDP2's ``FSDPModule``)."""

    def __deepcopy__(self, memo: dict) -> nn.Module:
        # nn.Module's own deep copy, then the leaves' check pointed at the copy: it holds its
        # module, and a copied check would read the original's leaves.
        cls = type(self)
        copied = cls.__new__(cls)
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        if getattr(self, _SHARDED, False):
            leaves.attach_check(copied)
        return copied

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduces gradients across ranks (default True).

        For gradient accumulation, turn it off for all micro-batches but the last::

            for i, micro_batch in enumerate(micro_batches):
                model.set_requires_gradient_sync(i == len(micro_batches) - 1)
                model(*micro_batch).backward()
            optimizer.step()

        Off, each trainable parameter accumulates its full local gradient (memory: one
        unsharded gradient per parameter, in the reduce dtype) and nothing is communicated in
        backward; turning it on reduces what was accumulated into the sharded ``.grad`` (a
        blocking collective: call it on every rank). Compiled models get one variant per
        setting, so alternating recompiles nothing. ``recurse``: also for every submodule.
        See :mod:`autoshard.grad_sync`.
        """
        grad_sync.set_requires_gradient_sync(self.modules() if recurse else [self], requires_gradient_sync)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation as with DDP and FSDP1 (what ``accelerate`` and Lightning call):
        backwards inside accumulate locally, leaving reduces what they accumulated (a blocking
        collective on every rank), so the next backward adds its reduced gradient. The
        setting in force before is restored on leaving (nested calls stay unsynchronised)."""
        before = all(m.__dict__.get(grad_sync.SYNC, True) for m in self.modules())
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(before)

    def set_gradient_divide_factor(self, factor: float | None, *, recurse: bool = True) -> None:
        """Gradients become their sum over the data-parallel ranks divided by ``factor``
        (1.0: summed, as torchtitan's loss divided by the global token count expects; None:
        averaged, the default), for every strategy, batch shares and experts; as FSDP2's
        method of the same name. See :mod:`autoshard.runtime.grad_scale`."""
        grad_scale.set_gradient_divide_factor(self.modules() if recurse else [self], factor)


# Inside parameters_as_shards(): a global, not a module attribute, so that entering and leaving
# changes nothing Dynamo guards on in a compiled model.
_as_shards = 0
_tensor_parallel = False  # set once any module is sharded over tensor parallelism (note_tensor_parallel)
_is_compiling = torch.compiler.is_compiling  # a global: one attribute lookup less per traced read
_alias = torch.ops.aten.alias.default


def _getter(name: str) -> Callable[[nn.Module], torch.Tensor]:
    """The property getter of sharded parameter ``name``: its full value, through its
    annotation op. Dynamo inlines this for every parameter use, so it is one flat function
    reading few attributes (an extra call level, a dict lookup or a call Dynamo runs for real
    each cost a use 1-4 ms to trace)."""
    leaf_attribute, ghost_attribute = leaves.leaf_attribute(name), leaves.ghost_attribute(name)
    sync, sinks = grad_sync.SYNC, grad_sync.SINKS

    def get(self: nn.Module) -> torch.Tensor:
        if _as_shards:
            return self._parameters[name]
        if _is_compiling():
            # For autoshard's backend, synchronised (leaves.show_reads): a graph input of the
            # full shape, which the backend gathers (autoshard/compiler/ghosts.py).
            ghost = getattr(self, ghost_attribute)
            if ghost is not None:
                # Through an op, not the ghost itself: a read that reaches code Dynamo does not
                # trace (a graph break's call) is then the graph's output, gathered, rather than
                # the ghost loaded back from this attribute. The capture removes the op.
                if not _tensor_parallel:  # a global: no spec lookup per traced read without it
                    return _alias(ghost)
                tp = self._autoshard_specs[name].tp
                return _alias(ghost) if tp is None else as_tensor_parallel(_alias(ghost), tp)
            leaf = getattr(self, leaf_attribute)  # synced as the root's forward was traced (_checked_forward)
        else:
            leaf = leaves.synced(leaves.leaves_of(self, name))
        spec = self._autoshard_specs[name]
        # Python constants that Dynamo guards on: one compiled variant per setting.
        sink = None if getattr(self, sync) or not leaf.requires_grad else getattr(self, sinks)[name]
        full = spec.op(leaf, *spec.head, sink, *spec.tail)
        return full if spec.tp is None else as_tensor_parallel(full, spec.tp)

    return get


_subclasses: dict[tuple[type, tuple[str, ...], bool], type] = {}
_base_of: dict[type, type] = {}  # sharded subclass -> the user's class
# Each sharded parameter keeps its spec under this attribute, so a module that shares an



def _apply_keeping_leaves(self: nn.Module, fn, recurse: bool = True) -> nn.Module:
    # .to(), to_empty() and friends may give shards new storage: the forward's leaves follow.
    result = _base_of[type(self)]._apply(self, fn, recurse)
    leaves.refresh(self)
    for module in self.modules():  # the new parameters lack the divide factor's scale
        grad_scale.reapply(module)
    return result


def _checked_forward(forward: Callable) -> Callable:
    """The forward of a module passed to ``shard``: its class's, after syncing the leaves under
    it as Dynamo starts tracing it (leaves.check_before_tracing). A method, not a forward
    pre-hook: Dynamo traces a compiled module's forward on every torch release, its hooks
    not on all."""

    @functools.wraps(forward)
    def checked(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        leaves.check_before_tracing(self)
        return forward(self, *args, **kwargs)

    return checked


def _sharded_class(cls: type, names: tuple[str, ...], root: bool = False) -> type:
    """A subclass of ``cls`` whose ``names`` are properties returning full parameters; for a
    module passed to ``shard`` (``root``), with its leaves checked as a forward is traced."""
    cls = _base_of.get(cls, cls)
    key = (cls, names, root)
    if key not in _subclasses:
        props: dict = {n: property(_getter(n)) for n in names}
        props["_apply"] = _apply_keeping_leaves
        if root:
            props["forward"] = _checked_forward(cls.forward)
        sub = type(f"Sharded{cls.__name__}", (cls, ShardedModule), props)
        _subclasses[key], _base_of[sub] = sub, cls
    return _subclasses[key]


def note_tensor_parallel() -> None:
    """Some sharded parameter is tensor-parallel: traced reads look up its layout."""
    global _tensor_parallel
    _tensor_parallel = True


@contextmanager
def parameters_as_shards() -> Iterator[None]:
    """Inside, reading a sharded parameter (``module.weight``, of any sharded module) gives
    the DTensor parameter itself, not the gathered copy a forward uses: for code that reads or
    writes shards (init, state dicts). Nothing is communicated."""
    global _as_shards
    _as_shards += 1
    try:
        yield
    finally:
        _as_shards -= 1


def _reclass(module: nn.Module) -> None:
    """Move ``module`` to the sharded subclass for the parameters it annotates (none: only
    :class:`ShardedModule`'s methods) and whether it was passed to ``shard``."""
    names = tuple(sorted(getattr(module, "_autoshard_specs", {})))
    module.__class__ = _sharded_class(type(module), names, root=leaves.CHECK in module.__dict__)
