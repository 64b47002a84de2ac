"""What the forward reads of a sharded parameter: a plain tensor, not the DTensor.

Each sharded parameter (an ``nn.Parameter`` holding a DTensor) gets two *leaves*: plain
``nn.Parameter`` views of its local shard (the same storage, no copy), one trainable, one
frozen. The annotation ops take the leaf, so neither Dynamo nor AOT autograd ever traces a
DTensor (``to_local``, subclass inputs, the mesh): per parameter use that was most of what
sharding added to compile time. The optimizer, ``state_dict`` and checkpoints still see only
the DTensor parameters.

The gradient autograd accumulates into the trainable leaf is the DTensor parameter's ``.grad``:
its local tensor *is* the leaf's ``.grad`` (:class:`_GradLink`), so accumulation adds in place
exactly as it would into the DTensor's ``.grad``, and ``zero_grad``, ``clip_grad_norm_`` and
optimizers act on both at once. Leaves are rebuilt when the shard's storage changes
(``module.to``, ``to_empty``: :func:`refresh`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard._compat import FakeTensor

LEAVES = "_autoshard_leaves"  # on each module owning sharded parameters: parameter name -> Leaves
_ON_PARAM = "_autoshard_leaves"  # on the DTensor parameter itself: shared by every module using it (tied)


class Leaves(NamedTuple):
    param: nn.Parameter  # the DTensor parameter they view
    trainable: nn.Parameter
    frozen: nn.Parameter


class _GradLink:
    """Makes the trainable leaf's ``.grad`` and the DTensor parameter's ``.grad`` one tensor."""

    def __init__(self, param: nn.Parameter, leaf: nn.Parameter) -> None:
        # Strong references: torch.utils.swap_tensors (module.to, to_empty) refuses a tensor
        # that has a weak one. The cycle through the leaf's hooks is the garbage collector's.
        self.param, self.leaf = param, leaf
        self.grad: DTensor | None = None  # the parameter's .grad, made (or adopted) around ...
        self.local: torch.Tensor | None = None  # ... the leaf's .grad

    def before(self, grad: torch.Tensor) -> None:
        # Before autograd accumulates into the leaf: start from the parameter's .grad as it is
        # now (None after zero_grad(set_to_none=True); another tensor if one was assigned).
        param, leaf = self.param, self.leaf
        if param.grad is self.grad:
            return
        self.grad = param.grad
        leaf.grad = self.local = None if param.grad is None else param.grad.to_local()

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


def _build(param: nn.Parameter) -> Leaves:
    with torch.no_grad():
        local = param.to_local().detach()
    trainable = nn.Parameter(local, requires_grad=True)
    link = _GradLink(param, trainable)
    trainable.register_hook(link.before)
    trainable.register_post_accumulate_grad_hook(link.after)
    leaves = Leaves(param, trainable, nn.Parameter(local, requires_grad=False))
    for leaf in leaves[1:]:
        leaf._autoshard_leaf = True  # the backend's "unsharded parameter" warning skips these
    setattr(param, _ON_PARAM, leaves)
    return leaves


def _current(leaves: Leaves | None, param: nn.Parameter) -> bool:
    if leaves is None or leaves.param is not param:
        return False
    local = param.to_local()
    leaf = leaves.frozen
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
        leaves = table[name] = shared if _current(shared, param) else _build(param)
    return leaves


def refresh(module: nn.Module) -> None:
    """Rebuild the leaves of every sharded parameter of ``module`` and its submodules whose
    shard changed storage (after ``module.to``, ``to_empty``)."""
    for m in module.modules():
        for name in getattr(m, "_autoshard_specs", {}):
            if isinstance(m._parameters.get(name), DTensor):
                leaves_of(m, name)
