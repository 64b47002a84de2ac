"""torchtitan with autoshard, no fork: name this module on torchtitan's command line::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module autoshard.integrations.torchtitan --config llama3_8B

``--config`` takes any config function of torchtitan's own models (``llama3_debugmodel``,
``qwen3_0_6B``, ``deepseek_v3_debugmodel``, ...): this module returns torchtitan's config with
:func:`parallelize` as the model's ``parallelize_fn`` (see :func:`with_autoshard`). Every other
torchtitan flag works as usual (``--training.*``, ``--parallelism.data_parallel_*``,
``--activation_checkpoint.*``, ``--compile.*``, ``--checkpoint.*``).

What :func:`parallelize` does in place of torchtitan's ``apply_fsdp``, and why:

* Shards the model (still on the meta device) over the data-parallel mesh: ``"full"`` (ZeRO-3)
  over ``fsdp``, ``"hybrid"`` over ``(dp_replicate, fsdp)``; ``training.mixed_precision_param`` /
  ``_reduce`` become :class:`autoshard.MixedPrecision`; ``parallelism.fsdp_reshard_after_forward``
  ``"always"`` / ``"never"`` / ``"default"`` map to ``reshard_after_forward`` True / False / None.
* Gradients are summed over the ranks (``set_gradient_divide_factor(1.0)``), as torchtitan's own
  FSDP does: its loss is already divided by the global count of valid tokens.
* The trainer then calls ``model.to_empty(...)`` and ``model.init_weights(...)``: the latter runs
  on the shards as one process would (:func:`autoshard.runtime.materialize.shards_in_place`),
  so every rank's shards are the slices of the model a single process initialises.
* Activation checkpointing is torchtitan's own (``ac_config``), applied before sharding.
* The model is compiled in place with ``backend="autoshard"``: sharding is a compiler pass, so
  it is compiled even without ``--compile.enable``; ``--compile.backend`` picks autoshard's inner
  compiler ("inductor", the default, "aot_eager" or "eager").

Refused with :class:`autoshard.UsageError`, before anything changes: tensor, context, pipeline
and expert parallelism (``--parallelism.*_degree`` > 1), which autoshard does not compose with
yet, and torchtitan's ``ChunkedLossWrapper`` when the model is given directly (it calls the
``lm_head`` outside the model's forward, where its weight is a shard): :func:`with_autoshard`
replaces it by the chunk loss it wraps (the same loss, computed unchunked).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

from autoshard.runtime.batch_shares import refill_weight
from autoshard.runtime.errors import UsageError
from autoshard.runtime.materialize import shards_in_place
from autoshard.runtime.mixed_precision import MixedPrecision
from autoshard.runtime.shard import shard

# torchtitan's models whose config registries this module re-exports (``<model>_<flavour>``).
MODELS = ("llama3", "qwen3", "deepseek_v3")
_INNER = ("inductor", "aot_eager", "eager")
_RESHARD = {"default": None, "always": True, "never": False}


def _dtype(name: str) -> Any:
    from torchtitan.config import TORCH_DTYPE_MAP  # torchtitan is imported only when used

    return TORCH_DTYPE_MAP[name]


def _inner(compile_config: Any) -> str:
    """autoshard's inner compiler: ``--compile.backend`` where compiling is on, else Inductor."""
    return compile_config.backend if compile_config.enable else "inductor"


def _refuse(parallel_dims: Any, parallelism: Any, compile_config: Any) -> None:
    others = {"tensor": parallel_dims.tp, "context": parallel_dims.cp, "pipeline": parallel_dims.pp,
              "expert": parallel_dims.ep}
    refused = [f"{kind} parallelism (degree {degree})" for kind, degree in others.items() if degree > 1]
    if refused:
        raise UsageError(f"autoshard.integrations.torchtitan: {', '.join(refused)} is not supported with autoshard; "
                         "use data parallelism only (--parallelism.data_parallel_shard_degree / _replicate_degree).")
    reshard = parallelism.fsdp_reshard_after_forward
    if reshard not in _RESHARD:
        raise UsageError(f"autoshard.integrations.torchtitan: parallelism.fsdp_reshard_after_forward={reshard!r}; "
                         f"use one of {tuple(_RESHARD)}.")
    inner = _inner(compile_config)
    if inner not in _INNER:
        raise UsageError(f"autoshard.integrations.torchtitan: compile.backend={inner!r} cannot be autoshard's inner compiler; "
                         f"use one of {_INNER} (the model is compiled once, with backend='autoshard').")


def _data_parallel_mesh(parallel_dims: Any) -> tuple[Any, str]:
    """The mesh to shard over (None: one rank, shard's default) and the strategy."""
    # torchtitan names the sharding axis "fsdp" under its partial_dtensor backend, "dp_shard" under the others.
    axis = "fsdp" if parallel_dims.spmd_backend == "partial_dtensor" else "dp_shard"
    if parallel_dims.dp_replicate_enabled:
        return parallel_dims.get_mesh(["dp_replicate", axis]), "hybrid"
    return parallel_dims.get_optional_mesh(axis), "full"


def _init_on_shards(model: nn.Module) -> None:
    """torchtitan calls ``model.init_weights(buffer_device=...)`` after ``to_empty``: run it on
    the shards, drawing as one process would."""
    init_weights: Callable[..., Any] = model.init_weights

    @functools.wraps(init_weights)
    def on_shards(*args: Any, **kwargs: Any) -> Any:
        refill_weight(model)  # autoshard's own buffer, emptied by to_empty
        with shards_in_place(model):
            return init_weights(*args, **kwargs)

    model.init_weights = on_shards


def parallelize(model: nn.Module, *, parallel_dims: Any, training: Any, parallelism: Any, compile_config: Any,
                ac_config: Any = None, dump_folder: str = "", **_: Any) -> nn.Module:
    """torchtitan's ``ModelSpec.parallelize_fn``, with autoshard's FSDP: see the module docstring."""
    _refuse(parallel_dims, parallelism, compile_config)
    mesh, strategy = _data_parallel_mesh(parallel_dims)
    precision = MixedPrecision(param_dtype=_dtype(training.mixed_precision_param),
                               reduce_dtype=_dtype(training.mixed_precision_reduce))
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    shard(model, mesh, strategy=strategy, mixed_precision=precision,
          reshard_after_forward=_RESHARD[parallelism.fsdp_reshard_after_forward])
    model.set_gradient_divide_factor(1.0)  # the loss is a sum over tokens / the global token count
    if callable(getattr(model, "init_weights", None)):
        _init_on_shards(model)
    model.compile(backend="autoshard", options={"compiler": _inner(compile_config)})
    return model


def with_autoshard(config: Any) -> Any:
    """torchtitan's ``Trainer.Config`` trained with autoshard: :func:`parallelize` as the model's
    ``parallelize_fn``, and a ``ChunkedLossWrapper`` replaced by the loss it wraps. Returns it."""
    from torchtitan.components.loss import ChunkedLossWrapper

    config.model_spec.parallelize_fn = parallelize
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        config.loss = config.loss.loss_fn
    return config


def _registry_function(name: str) -> Callable[[], Any] | None:
    import importlib

    for model in MODELS:
        if name.startswith(model + "_"):
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
            make = getattr(registry, name, None)
            if callable(make):
                return make
    return None


def __getattr__(name: str) -> Callable[[], Any]:
    """``--config <name>``: torchtitan's config function of that name, with autoshard."""
    make = _registry_function(name)
    if make is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: name a config of torchtitan's "
                             f"{', '.join(MODELS)} config registries, e.g. llama3_debugmodel")

    @functools.wraps(make)
    def config() -> Any:
        return with_autoshard(make())

    return config
