"""What the forward reads of a sharded parameter: a plain tensor, not the DTensor.

Each sharded parameter (an ``nn.Parameter`` holding a DTensor) gets a *leaf*: a plain
``nn.Parameter`` view of its local shard (the same storage, no copy) whose ``requires_grad``
follows the parameter's. The annotation ops take the leaf, so neither Dynamo nor AOT autograd
ever traces a DTensor (``to_local``, subclass inputs, the mesh): per parameter use that was
most of what sharding added to compile time. The optimizer, ``state_dict`` and checkpoints
still see only the DTensor parameters.

``requires_grad`` is set on the DTensor parameter, where autoshard cannot see it change, and
read from the leaf, which Dynamo guards on. It is copied over whenever a forward reads the
parameter eagerly; for every parameter under a module passed to ``shard`` when Dynamo traces
that module's forward, which calls :func:`check_before_tracing` first (once per traced
forward, not once per parameter use, which slowed the tracing of every use: docs/design.md,
"2. Capture"); and, for changes after compiling, by the compiled graph before each call
(:func:`stale`; the backend then runs that call eagerly and Dynamo recompiles the next one). A
compiled submodule that was not itself passed to ``shard`` has no such check: a change made
before its first compiled call is then caught by :func:`stale` (one eager call, and on torch
releases that do not retrace on an input's ``requires_grad`` alone, eager calls until the root
is traced again).

Each leaf has a *ghost*: a tensor of the full parameter's shape and compute dtype that holds
one element. While Dynamo traces a forward for autoshard's backend (:data:`GHOSTS`, set as a
root's forward is traced), a synchronised read returns the ghost: a plain graph input, as
cheap to trace as an unsharded parameter, where an annotation op per use costs Dynamo far more
(figures in docs/design.md, "2. Capture"). The backend hands the compiled graph the leaf in its
place and gathers it there (autoshard/compiler/ghosts.py). Any other backend gets the
annotation op per use (real collectives), never a ghost. (A module compiled on its own with
another backend after its root was traced for autoshard's would still read ghosts; they hold
NaN, so its outputs say so.)

The gradient autograd accumulates into the trainable leaf is the DTensor parameter's ``.grad``:
its local tensor *is* the leaf's ``.grad`` (:class:`_GradLink`), so accumulation adds in place
exactly as it would into the DTensor's ``.grad``, and ``zero_grad``, ``clip_grad_norm_`` and
optimizers act on both at once. Leaves are rebuilt when the shard's storage changes
(``module.to``, ``to_empty``: :func:`refresh`).
"""
from __future__ import annotations

import hashlib
import weakref
from typing import Any, Iterator, NamedTuple, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard._compat import FakeTensor, keep_shape_static, tracing_for_backend

LEAVES = "_autoshard_leaves"  # on each module owning sharded parameters: parameter name -> Leaves
# On a DTensor parameter: what its reduced (averaged) gradient is multiplied by as it reaches
# .grad; absent: 1 (autoshard/runtime/grad_scale.py).
GRAD_SCALE = "_autoshard_grad_scale"
DIVIDE_FACTOR = "_autoshard_divide_factor"  # on each module: the factor set (None: averaged)
_ON_PARAM = "_autoshard_leaves"  # on the DTensor parameter itself: shared by every module using it (tied)


class Leaves(NamedTuple):
    param: nn.Parameter  # the DTensor parameter it views
    leaf: nn.Parameter
    ghost: torch.Tensor  # what a forward traced for autoshard reads: the full parameter's shape, no memory
    spec: Any  # the parameter's annotation (autoshard.runtime.sharded.ParamSpec)


class _GradLink:
    """Makes the trainable leaf's ``.grad`` and the DTensor parameter's ``.grad`` one tensor."""

    def __init__(self, param: nn.Parameter, leaf: nn.Parameter) -> None:
        # Strong references: torch.utils.swap_tensors (module.to, to_empty) refuses a tensor
        # that has a weak one. The cycle through the leaf's hooks is the garbage collector's.
        self.param, self.leaf = param, leaf
        self.grad: DTensor | None = None  # the parameter's .grad, made (or adopted) around ...
        self.local: torch.Tensor | None = None  # ... the leaf's .grad

    def before(self, grad: torch.Tensor) -> torch.Tensor | None:
        # Before autograd accumulates into the leaf: start from the parameter's .grad as it is
        # now (None after zero_grad(set_to_none=True); another tensor if one was assigned).
        param, leaf = self.param, self.leaf
        if param.grad is not self.grad:
            self.grad = param.grad
            leaf.grad = self.local = None if param.grad is None else param.grad.to_local()
        # A divide factor (grad_scale.py): every reduced gradient passes here, compiled or not.
        scale = param.__dict__.get(GRAD_SCALE)
        return None if scale is None else grad * scale

    def after(self, leaf: torch.Tensor) -> None:
        # Accumulated in place into the adopted .grad: nothing to do. A new tensor (the first
        # gradient, or accumulated out of place): the parameter's .grad wraps it.
        param = self.param
        if leaf.grad is None or (leaf.grad is self.local and self.grad is not None):
            return  # no gradient arrived (it went to a sink), or it was added in place
        self.local = leaf.grad
        self.grad = param.grad = DTensor.from_local(
            leaf.grad, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )


GHOST = "_autoshard_ghost"  # on each ghost: its Leaves


def one_element(shape: torch.Size, dtype: torch.dtype, device: torch.device, value: float = 0.0) -> torch.Tensor:
    """A tensor of ``shape`` holding one element of its own, ``value`` (stride 0): a full
    parameter's shape for the memory of one element."""
    return torch.full((), value, dtype=dtype, device=device).expand(shape).detach()


def _build(param: nn.Parameter, spec: Any) -> Leaves:
    with torch.no_grad():
        local = param.to_local().detach()
    leaf = nn.Parameter(local, requires_grad=True)  # hooks need it; set to the parameter's below
    link = _GradLink(param, leaf)
    leaf.register_hook(link.before)
    leaf.register_post_accumulate_grad_hook(link.after)
    leaf.requires_grad_(param.requires_grad)
    leaf._autoshard_leaf = True  # the backend's "unsharded parameter" warning skips these
    leaf._autoshard_param = param
    # While Dynamo traces, a read returns the ghost, a graph input as cheap to trace as a plain
    # parameter; the backend gives the graph the leaf instead and gathers it (compiler/ghosts.py).
    # NaN: a graph that computed with the ghost itself would say so.
    dtype = spec.param_dtype or param.dtype
    ghost = one_element(gathered_shape(param, spec), dtype, local.device, float("nan") if dtype.is_floating_point else 0.0)
    ghost.requires_grad_(param.requires_grad)
    # Static, as parameters are: a frame reading it (a getter compiled on its own, after its
    # caller was skipped) recompiled for another parameter's shape must not become one graph for
    # every shape, whose gathers would keep the first parameter's sizes.
    keep_shape_static(ghost)
    leaves = Leaves(param, leaf, ghost, spec)
    setattr(ghost, GHOST, leaves)
    setattr(param, _ON_PARAM, leaves)
    return leaves


def gathered_shape(param: nn.Parameter, spec: Any) -> tuple[int, ...]:
    """The shape a forward gathers ``param`` to: its own, or its tp-local piece's under tensor
    parallelism (autoshard/runtime/tensor_parallel.py)."""
    tp = getattr(spec, "tp", None)  # expert parallelism's specs have none
    return param.shape if tp is None else tp.local_shape


def synced(leaves: Leaves) -> nn.Parameter:
    """The leaf, its ``requires_grad`` (and its ghost's) made the parameter's."""
    leaf, wanted = leaves.leaf, leaves.param.requires_grad
    if leaf.requires_grad != wanted:
        leaf.requires_grad_(wanted)
        leaves.ghost.requires_grad_(wanted)
    return leaf


def leaf_attribute(name: str) -> str:
    """Where a module keeps the leaf of its sharded parameter ``name`` (in its ``__dict__``:
    one attribute read per parameter use is what Dynamo traces fastest)."""
    return f"_autoshard_leaf_{name}"


def ghost_attribute(name: str) -> str:
    """Where a module keeps what a traced read of its sharded parameter ``name`` returns
    directly: the ghost while :func:`reads_ghosts`, else None (see :func:`leaf_attribute`)."""
    return f"_autoshard_ghost_{name}"


def ghost_leaves(x: Any) -> Leaves | None:
    """The leaves of ``x`` if it is a ghost, else None."""
    return getattr(x, GHOST, None) if isinstance(x, torch.Tensor) else None


CHECK = "_autoshard_check_leaves"  # on each module passed to shard(): see attach_check
LAYOUT = "_autoshard_layout"  # on each module passed to shard(): its sharding in one string, see attach_check
# On each module owning sharded parameters: whether the graph being traced gathers ghosts. Set
# as Dynamo starts tracing a root's forward (attach_check): only for autoshard's backend (any
# other would compute with them).
GHOSTS = "_autoshard_ghosts"
# On the same modules: whether backward reduces their gradients (autoshard.runtime.grad_sync
# sets it). Unsynchronised gradients go to sinks, through the annotation op: no ghost.
SYNC = "_autoshard_sync"


def reads_ghosts(module: nn.Module) -> bool:
    """Whether a traced read of ``module``'s sharded parameters returns their ghosts."""
    return module.__dict__.get(GHOSTS, False) and module.__dict__.get(SYNC, True)


def show_reads(module: nn.Module) -> None:
    """Point each of ``module``'s ghost attributes at what a traced read returns directly:
    its ghost where :func:`reads_ghosts`, else None. Called wherever either flag changes.

    The read is one attribute Dynamo guards on, so a change retraces; reading the two flags
    themselves at every parameter use was half of what a use cost Dynamo beyond a plain
    parameter (~2,200 Python calls)."""
    ghosts = reads_ghosts(module)
    for name, leaves in module.__dict__.get(LEAVES, {}).items():
        module.__dict__[ghost_attribute(name)] = leaves.ghost if ghosts else None


def attach_check(root: nn.Module) -> None:
    """Give ``root`` (a module passed to ``shard``) the check :func:`check_before_tracing`
    calls: it rebuilds every leaf under ``root`` whose shard moved and makes each leaf's
    ``requires_grad`` its parameter's. Dynamo runs it for real while tracing (a constant
    result, so it traces no DTensor), once per forward rather than once per parameter use;
    its argument, :data:`changes`, is what Dynamo guards on. A copy of ``root`` needs its own,
    as the check holds its module."""
    owner = weakref.ref(root)

    def check(changes_seen: int, layout: str) -> bool:  # both for Dynamo's guards (check_before_tracing)
        ghosts = tracing_for_backend()
        modules = {}
        for module, name in _sharded(owner()):
            synced(leaves_of(module, name))
            modules[id(module)] = module
        for module in modules.values():
            module.__dict__[GHOSTS] = ghosts
            show_reads(module)
        return True

    root.__dict__[CHECK] = torch.compiler.assume_constant_result(check)
    root.__dict__[LAYOUT] = layout_key(root)


def layout_key(root: nn.Module) -> str:
    """Every sharded parameter's spec under ``root`` (groups, rows, reshard, dtypes), hashed.
    A traced read returns a ghost, which carries the spec to the backend but not into Dynamo's
    guards: two models of one class sharded differently would share a compiled graph (and its
    collectives) without this string, which the traced forward passes to the check."""
    specs = (m._autoshard_specs[name] for m, name in _sharded(root))
    # Sorted as text: a replicated parameter's head holds its name where a sharded one's holds rows.
    return hashlib.sha1(repr(sorted(repr((spec.head, spec.tail)) for spec in specs)).encode()).hexdigest()


def check_before_tracing(root: nn.Module) -> None:
    """What the forward of each module passed to ``shard`` calls first: while Dynamo traces,
    sync the leaves the traced reads will wrap (eagerly each read syncs its own leaf), and say
    whether they may read ghosts. Its arguments are what Dynamo guards on: :data:`changes` and
    the root's sharding (:func:`layout_key`)."""
    if torch.compiler.is_compiling():
        root.__dict__[CHECK](changes, getattr(root, LAYOUT))


# How many times a compiled graph found a parameter's requires_grad changed since it was
# traced. Every traced forward of a sharded root passes it to :func:`attach_check`'s check, so Dynamo
# guards on it and retraces after a change (not every torch release guards on a graph input's
# requires_grad, which the leaf alone would rely on).
changes = 0

Tracked = tuple[tuple[nn.Parameter, ...], tuple[bool, ...]]  # parameters, and requires_grad when traced


def tracked(inputs: Sequence[Any]) -> Tracked:
    """The parameters whose leaves are among a compiled graph's inputs, with the
    ``requires_grad`` the graph was traced with."""
    found = [x for x in inputs if getattr(x, "_autoshard_leaf", False)]
    return tuple(x._autoshard_param for x in found), tuple(x.requires_grad for x in found)


def stale(graph: Tracked) -> bool:
    """Whether a parameter's ``requires_grad`` changed since the graph was traced. If so, the
    leaves are synced and :data:`changes` counts it, so Dynamo traces the next call anew."""
    global changes
    params, traced = graph
    if all(param.requires_grad == was for param, was in zip(params, traced)):
        return False
    changes += 1
    for param in params:
        synced(getattr(param, _ON_PARAM))
    return True


def _current(leaves: Leaves | None, param: nn.Parameter) -> bool:
    if leaves is None or leaves.param is not param:
        return False
    local = param.to_local()
    leaf = leaves.leaf
    if (leaf.device, leaf.dtype, leaf.shape) != (local.device, local.dtype, local.shape):
        return False
    if isinstance(local, FakeTensor):  # explain's fake shards have no memory to move
        return True
    return leaf.data_ptr() == local.data_ptr()


def leaves_of(module: nn.Module, name: str) -> Leaves:
    """The leaves of ``module``'s sharded parameter ``name``, rebuilt if its shard moved."""
    param = module._parameters[name]
    table = module.__dict__.setdefault(LEAVES, {})
    leaves = table.get(name)
    if not _current(leaves, param):
        shared = getattr(param, _ON_PARAM, None)
        leaves = table[name] = shared if _current(shared, param) else _build(param, module._autoshard_specs[name])
        module.__dict__[leaf_attribute(name)] = leaves.leaf
        module.__dict__[ghost_attribute(name)] = leaves.ghost if reads_ghosts(module) else None
    return leaves


def rename(module: nn.Module, name: str, spec: Any) -> None:
    """Give the leaves of ``module``'s parameter ``name`` its spec ``spec`` where only the
    parameter's name grew a prefix: a root sharded after its blocks names their parameters from
    the root (``fc.weight`` -> ``blocks.0.fc.weight``), and the ghost's gather must carry that
    name (bucketing groups parameters by their block). A tied parameter keeps its first name."""
    leaves = leaves_of(module, name)
    if leaves.spec is spec or not spec.name.endswith("." + leaves.spec.name):
        return
    renamed = leaves._replace(spec=spec)
    setattr(renamed.ghost, GHOST, renamed)
    setattr(renamed.param, _ON_PARAM, renamed)
    module.__dict__[LEAVES][name] = renamed


def refresh(module: nn.Module) -> None:
    """Rebuild the leaves of every sharded parameter of ``module`` and its submodules whose
    shard changed storage (after ``module.to``, ``to_empty``)."""
    for m, name in _sharded(module):
        leaves_of(m, name)


def _sharded(module: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """(owner, name) of every sharded parameter of ``module`` and its submodules."""
    for m in module.modules():
        for name in getattr(m, "_autoshard_specs", {}):
            if isinstance(m._parameters.get(name), DTensor):
                yield m, name
