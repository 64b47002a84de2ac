"""The sharding frontend: ``autoshard.shard(module)`` turns parameters into per-rank shards.

Every parameter becomes an ``nn.Parameter`` holding a DTensor laid out by the strategy:

* ``"full"`` (ZeRO-3, default) and ``"grad_op"`` (ZeRO-2): ``Shard(0)`` over a 1-D mesh;
  ``"grad_op"`` keeps gathered parameters from forward to backward.
* ``"replicate"`` (DDP): ``Replicate()``: every rank holds everything, gradients are
  all-reduced.
* ``"hybrid"`` (HSDP): over a 2-D mesh ``(replicas, shard)``: ``(Replicate(), Shard(0))``,
  sharded within a row of the mesh and replicated down its columns.

0-d parameters, which cannot be split, are always replicated. Optimizers, ``clip_grad_norm_``
and ``torch.distributed.checkpoint`` therefore work on the shards. Each module that owns
parameters (and the module passed to ``shard``) is moved to a subclass whose parameter names
are properties: reading ``module.weight`` returns the full parameter through
:mod:`autoshard.ops`. ``state_dict`` keys stay unchanged because the parameters still live
in ``module._parameters``.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from autoshard.runtime import experts as expert_parallelism
from autoshard.runtime import grad_sync, hpz, leaves, tensor_parallel
from autoshard.runtime.batch_shares import normalize, note_uneven_shares, set_batch_shares
from autoshard.runtime.compression import Compression, check_compression, gather_block_for, reduce_block_for
from autoshard.runtime.errors import UsageError
from autoshard.runtime.fail_together import check_same_on_all_ranks
from autoshard.runtime.layout import ShardLayout, layout, to_dtensor
from autoshard.runtime.mixed_precision import MixedPrecision, cast_inputs_hook, dtypes_for
from autoshard.runtime.shard_checks import STRATEGIES, check_arguments, state_fractions
from autoshard.runtime.sharded import (  # re-exported: imported from here before the split
    _SHARDED,
    ParamSpec,
    ShardedModule,
    _reclass,
    is_sharded,
    note_tensor_parallel,
    parameters_as_shards,
)
from autoshard.runtime.state_shares import split_rows

__all__ = ["STRATEGIES", "ParamSpec", "ShardedModule", "is_sharded", "parameters_as_shards", "shard"]

# Each sharded parameter keeps its spec under this attribute, so a module that shares an
# already sharded parameter (a tied head sharded after its embedding) gets the same annotation.
_SPEC = "_autoshard_spec"
_SHARDED_AS = "_autoshard_sharded_as"  # on a replaced plain parameter: its shard


def _default_mesh(module: nn.Module, shape: tuple[int, ...] | None = None) -> DeviceMesh:
    """Every rank of the default group, laid out as ``shape`` (default: one dimension), on the
    device type of the module's parameters."""
    device = next(iter(module.parameters()), torch.empty(0)).device.type
    if device == "meta":  # built for later materialization: where it will live, as FSDP2 assumes
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, shape or (dist.get_world_size(),))


def _planned(module: nn.Module, given: Any, mesh: DeviceMesh | None, strategy: str, mixed_precision: MixedPrecision | None,
             experts: str, state_shares: Any = None, compression: Compression | None = None) -> tuple:
    """The mesh, strategy, mixed precision, experts layout and compression of a
    :class:`ShardLayout` (or of an ``autoshard.Plan``'s ``layout``) for the root, after
    sharding the blocks it lays out otherwise (every name checked first)."""
    plan = getattr(given, "layout", given)  # an autoshard.Plan carries its layout
    if not isinstance(plan, ShardLayout):
        raise UsageError(f"autoshard.shard: plan= takes an autoshard.Plan or a ShardLayout, got {type(given).__name__}; "
                         "make one with autoshard.plan.")
    if mesh is not None or strategy != "full" or mixed_precision is not None or experts != "gathered":
        raise UsageError("autoshard.shard: pass either plan= or mesh/strategy/mixed_precision/experts, not both: the plan chooses them.")
    if compression is not None and plan.compression is not None:
        raise UsageError(f"autoshard.shard: the plan chose compression {plan.compression!r}; pass either plan= or compression=, "
                         "not both (plan without the int8 precisions to choose compression yourself).")
    compression = compression or plan.compression
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.world_size:
        raise UsageError(f"autoshard.shard: the plan was made for {plan.world_size} ranks but this process group has {world}; "
                         f"plan again with world_size={world}.")
    if getattr(module, _SHARDED, False):
        check_arguments(module, None, "full", None, None)  # raises that it is sharded already, before a block changes
    if {plan.strategy, plan.block_strategy or plan.strategy} - set(STRATEGIES):
        raise UsageError(f"autoshard.shard: the plan's strategies must be among {STRATEGIES}, got {plan.strategy!r} and "
                         f"{plan.block_strategy!r}; plan again with autoshard.plan.")
    missing = [name for name in plan.blocks if not _has(module, name)]
    if missing:
        raise UsageError(f"autoshard.shard: the plan lays out {missing[0]!r}, which {type(module).__name__} does not have; "
                         "plan again for this model.")
    for planned in dict.fromkeys((plan.strategy, plan.block_strategy or plan.strategy)):
        state_fractions(state_shares, planned, plan.experts)  # refused before a block changes
        check_compression(compression, planned)
    if not dist.is_initialized():
        return None, plan.strategy, None, plan.experts, compression  # world size 1: nothing to shard
    if plan.blocks:  # blocks first, then the root, as with FSDP2's fully_shard
        block_mesh = _default_mesh(module, tuple(plan.block_mesh_shape))
        for name in plan.blocks:
            shard(module.get_submodule(name), block_mesh, strategy=plan.block_strategy, mixed_precision=plan.mixed_precision,
                  state_shares=state_shares, compression=compression)
    return _default_mesh(module, tuple(plan.mesh_shape)), plan.strategy, plan.mixed_precision, plan.experts, compression


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


# id of a parameter to shard -> it, placements, every rank's rows under state shares (() even)
Layouts = dict[int, tuple[nn.Parameter, list[Placement], tuple[int, ...]]]
Owners = list[tuple[nn.Module, dict[str, ParamSpec]]]  # each module owning parameters, with their specs


def _describe(owners: Owners, layouts: Layouts, strategy: str, mesh: DeviceMesh,
              mixed_precision: MixedPrecision | None, compression: Compression | None = None) -> list[tuple]:
    """What must be equal on every rank: the call's settings, then every parameter's name,
    global shape, dtype, trainability and layout."""
    items: list[tuple] = [("shard", strategy, tuple(mesh.shape), repr(mixed_precision), repr(compression))]
    for mod, specs in owners:
        for name, spec in specs.items():
            param = mod._parameters[name]
            items.append((spec.name, tuple(param.shape), str(param.dtype), param.requires_grad, spec.dim0, spec.reshard,
                          id(param) in layouts, spec.rows, spec.quant_block, spec.reduce_block, spec.node_size, spec.quant_codec))
    return items


def shard(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    reshard_after_forward: bool | int | None = None,
    strategy: str = "full",
    mixed_precision: MixedPrecision | None = None,
    plan: Any = None,
    batch_shares: Any = None,
    state_shares: Any = None,
    experts: str = "gathered",
    compression: Compression | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters in place across the ranks of ``mesh`` and return it.

    Args:
        module: any ``nn.Module``. Parameters already sharded by an earlier ``shard`` call on a
            submodule keep their settings; buffers stay replicated.
        mesh: a 1-D DeviceMesh (2-D ``(replicas, shard_size)`` for ``"hybrid"``); default:
            every rank of the default process group, on the device type of the module's
            parameters. Without a process group there is nothing to shard (world size 1): the
            module is only marked, and ``strategy`` and ``mixed_precision`` change nothing.
        reshard_after_forward: free gathered parameters after forward and gather them again
            in backward (ZeRO-3). ``False`` keeps them from forward to backward. Default, for
            ``"full"`` and ``"hybrid"``: all but those the backward needs first, the last
            repeated block and the parameters first used after it (torchtitan's default for
            FSDP2: kept, they cost no memory at the step's peak and save the backward's first,
            exposed gathers), and, given the backend's ``memory_budget_gb``, as many blocks
            before it, last first, as fit the budget (``passes/keep.py``); False for
            ``"grad_op"`` (and ``"replicate"``, which gathers nothing); True with those two is
            an error. An int G (strategy ``"full"``; G divides the N ranks; G == N is True,
            G == 1 False): hierarchical backward gathers (ZeRO++'s hpZ, FSDP2's int): each rank
            keeps its node's 1/G of every gathered parameter from forward to backward, and the
            backward gathers over the G ranks of its node only (:mod:`autoshard.runtime.hpz`).
        strategy: ``"full"`` (ZeRO-3), ``"grad_op"`` (ZeRO-2: parameters stay gathered from
            forward to backward; gradients and optimizer state sharded), ``"replicate"``
            (DDP: full parameters on every rank, gradients all-reduced in buckets during the
            backward) or ``"hybrid"`` (HSDP: sharded within the mesh's second dimension,
            replicated over its first; gradients reduce-scattered within, then all-reduced
            across).
        mixed_precision: an :class:`autoshard.MixedPrecision`: gather and compute in
            ``param_dtype``, reduce gradients in ``reduce_dtype``; the sharded parameters and
            the optimizer state keep their dtype.
        plan: an :class:`autoshard.Plan` (:func:`autoshard.plan`) or its ``layout`` (a
            :class:`ShardLayout`): its strategy, precision and experts layout
            on the mesh it describes, built over every rank (instead of ``mesh``, ``strategy``,
            ``mixed_precision`` and ``experts``).
        batch_shares: each rank's share of the global batch, one positive number per rank
            (sample counts such as ``[3, 1]``, or fractions), or an ``autoshard.Plan``
            carrying ``batch_shares``: see :func:`autoshard.set_batch_shares`. Default: the
            ``plan``'s ``batch_shares`` if it has them, else equal.
        state_shares: each rank's share of the parameters, gradients and optimizer state, one
            positive number per rank (``[3, 1]``: rank 0 holds three quarters of every
            parameter's rows), or an ``autoshard.Plan`` carrying ``state_shares``: for ranks
            with less memory (:mod:`autoshard.runtime.state_shares`). Strategies ``"full"``
            and ``"grad_op"`` only. Default: the ``plan``'s ``state_shares``, else equal.
        experts: ``"gathered"`` (default): experts modules are sharded like any parameter and
            gathered whole where used. ``"parallel"``: expert parallelism over every rank of a
            1-D mesh: each experts module (3-D parameters sharing a leading expert dimension,
            called as ``experts(hidden_states, top_k_index, top_k_weights)``) keeps
            ``E / world_size`` whole experts per rank, never gathered, and tokens travel to
            them by all-to-all (:mod:`autoshard.runtime.experts`); ``E`` must divide evenly.
        compression: an :class:`autoshard.Compression`: ``gather="int8"`` gathers every
            sharded floating-point parameter as int8 with block-wise scales, dequantized to
            ``param_dtype`` (or its own dtype) after the gather; shards, gradients and the
            optimizer state keep their dtype; ``reduce="int8"`` reduces their gradients by an
            all-to-all of int8 chunks, averaged in float32 on the receiving rank. Lossy, so
            off by default; a group of one rank gathers nothing and compresses nothing. Not
            with ``"replicate"``.

    Build the optimizer after calling ``shard`` (as with FSDP2): it must see the sharded
    parameters. Parameters shared by several modules (tied weights) are sharded once.
    Nothing is changed when an argument is refused.

    Each rank cuts its shards from its own copy, as ``fully_shard`` does: every rank must hold
    the same values (same seed), or build on the meta device and call
    :func:`autoshard.materialize` afterwards. Before anything changes, one all-gather of a hash
    checks that every rank shards the same structure (names, shapes, dtypes, strategy, mesh);
    if not, every rank raises the same ``UsageError`` naming the first difference.
    """
    if plan is not None:
        if state_shares is None:
            state_shares = getattr(plan, "state_shares", None)
        mesh, strategy, mixed_precision, experts, compression = _planned(module, plan, mesh, strategy, mixed_precision, experts,
                                                                         state_shares, compression)
        if batch_shares is None:  # a plan for a mixed cluster chose them
            batch_shares = getattr(plan, "batch_shares", None)
    check_arguments(module, mesh, strategy, reshard_after_forward, mixed_precision)
    check_compression(compression, strategy)
    fractions = state_fractions(state_shares, strategy, experts)
    if experts not in expert_parallelism.EXPERTS:
        raise UsageError(f"autoshard.shard: experts must be one of {expert_parallelism.EXPERTS}, got {experts!r}.")
    if not dist.is_initialized():
        if mixed_precision is not None:
            warnings.warn(
                "autoshard.shard: no process group, so nothing is sharded and mixed_precision is ignored; "
                "use torch.autocast for mixed precision in a single process.",
                stacklevel=2,
            )
        if compression is not None and (compression.gather is not None or compression.reduce is not None):
            warnings.warn("autoshard.shard: no process group, so nothing is gathered or reduced and compression is ignored.",
                          stacklevel=2)
        _reclass(module)
        setattr(module, _SHARDED, True)
        if batch_shares is not None:
            set_batch_shares(module, batch_shares)
        return module
    if batch_shares is not None:  # refused before anything changes
        normalize(batch_shares, dist.get_world_size(), what="autoshard.shard")
    mesh = mesh if mesh is not None else _default_mesh(module)
    reshard_after_forward, node_size = hpz.node_size(reshard_after_forward, mesh.size())
    if reshard_after_forward is None and strategy not in ("full", "hybrid"):
        reshard_after_forward = False  # None stays: the lowering keeps what the backward needs first
    # Plan every new parameter, agree, build them all, then install: nothing is half-applied.
    found = expert_parallelism.plan(module, mesh) if experts == "parallel" else []
    skip = {id(p) for _, m in found for p in m.parameters(recurse=False)}
    composed = tensor_parallel.composition(module, mesh, strategy, _SPEC, fractions, node_size, compression, found)
    layouts, owners = _plan(module, mesh, strategy, reshard_after_forward, mixed_precision, skip, fractions, compression, node_size,
                            composed)
    # Ranks that built different models would otherwise hang or train apart: fail alike first.
    described = _describe(owners, layouts, strategy, mesh, mixed_precision, compression) + expert_parallelism.describe(found)
    described.insert(0, ("state_shares", None if fractions is None else [str(f) for f in fractions]))
    check_same_on_all_ranks("autoshard.shard", described, mesh.device_type)
    if node_size:  # made once every rank agrees on G: every rank makes every node's group
        group = hpz.node_group(mesh, node_size)
        owners = [(m, {n: replace(s, node_group=group) if s.node_size and not s.node_group else s for n, s in specs.items()})
                  for m, specs in owners]
    expert_parallelism.install(found, mesh)
    build = functools.partial(composed.to_dtensor, dp_mesh=mesh) if composed else functools.partial(to_dtensor, mesh=mesh)
    sharded = {key: nn.Parameter(build(param, placements=placements, rows=rows), requires_grad=param.requires_grad)
               for key, (param, placements, rows) in layouts.items()}
    if fractions is not None:
        note_uneven_shares()  # ranks hold other shard shapes: they take rank 0's compile decisions
    if composed:
        note_tensor_parallel()
    _install(module, owners, sharded, mixed_precision)
    if batch_shares is not None:
        set_batch_shares(module, batch_shares)
    return module


def _plan(
    module: nn.Module, mesh: DeviceMesh, strategy: str, reshard: bool | None, mixed_precision: MixedPrecision | None,
    skip: set[int] = frozenset(), fractions: tuple | None = None, compression: Compression | None = None, node_size: int = 0,
    composed: tensor_parallel.Composition | None = None,
) -> tuple[Layouts, Owners]:
    """(each new parameter's placements by id, each owning module's specs), changing nothing."""
    groups, split, replicated = layout(mesh, strategy)
    layouts: Layouts = {}
    owners: Owners = []
    for prefix, mod in module.named_modules():
        specs = {}
        for name, param in mod._parameters.items():
            if param is None or id(param) in skip or getattr(param, expert_parallelism.MARK, False):
                continue  # experts split by expert parallelism, never gathered
            fqn = f"{prefix}.{name}" if prefix else name
            # Sharded by an earlier call on a submodule: keep its settings, name it from here.
            if name in getattr(mod, "_autoshard_specs", {}):
                specs[name] = replace(mod._autoshard_specs[name], name=fqn)
                continue
            # A parameter shared with a module sharded earlier (a tied head whose embedding
            # was sharded first) is replaced by that shard.
            param = getattr(param, _SHARDED_AS, param)
            if hasattr(param, _SPEC):
                specs[name] = replace(getattr(param, _SPEC), name=fqn)
                continue
            # Tensor-parallel (composition() found every such DTensor): gathered to its tp-local piece.
            tp = composed.tensor_parallel(fqn, param) if isinstance(param, DTensor) else None
            splits = param.dim() > 0 and strategy != "replicate" and not (tp and tp.strided)
            dim0 = (tp.local_shape if tp else param.shape)[0] if splits else -1
            rows = split_rows(dim0, fractions) if splits and fractions else ()
            placements = split if splits else replicated
            if composed:
                placements = composed.placements(placements, tp.placements[0] if tp else Replicate())
            layouts[id(param)] = (param, placements, rows)
            param_dtype, reduce_dtype = dtypes_for(param, mixed_precision)
            # Only where a gather moves bytes: a group of one rank gathers nothing.
            quant_block = gather_block_for(param, compression) if splits and groups["world_size"] > 1 else 0
            reduce_block = reduce_block_for(param, compression) if splits and groups["world_size"] > 1 else 0
            specs[name] = ParamSpec(
                dim0=dim0, reshard=reshard if splits else False, name=fqn, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                rows=rows, quant_block=quant_block, reduce_block=reduce_block, node_size=node_size if splits else 0,
                quant_codec=compression.gather if quant_block else "int8", tp=tp, **groups
            )
        if specs:
            owners.append((mod, specs))
    return layouts, owners


def _install(module: nn.Module, owners: Owners, sharded: dict[int, nn.Parameter], mixed_precision: MixedPrecision | None) -> None:
    """Put the new parameters in place and move each owner to its sharded class."""
    for mod, specs in owners:
        for name, spec in specs.items():
            old = mod._parameters[name]
            new = sharded[id(old)] if id(old) in sharded else getattr(old, _SHARDED_AS, old)
            if new is not old:
                setattr(old, _SHARDED_AS, new)
            setattr(new, _SPEC, spec)
            mod._parameters[name] = new
        mod._autoshard_specs = {**getattr(mod, "_autoshard_specs", {}), **specs}
        for name, spec in specs.items():
            leaves.rename(mod, name, spec)
        _reclass(mod)
        setattr(mod, grad_sync.SYNC, getattr(mod, grad_sync.SYNC, True))
        setattr(mod, leaves.GHOSTS, getattr(mod, leaves.GHOSTS, False))  # set as a root's forward is traced
        leaves.show_reads(mod)
    leaves.attach_check(module)
    _reclass(module)
    if mixed_precision is not None and mixed_precision.param_dtype is not None and mixed_precision.cast_forward_inputs:
        module.register_forward_pre_hook(cast_inputs_hook(mixed_precision.param_dtype), with_kwargs=True)
    setattr(module, _SHARDED, True)
