"""Lightning with autoshard: ``Fabric(strategy="autoshard")`` and ``Trainer(strategy="autoshard")``
once this module is imported (``import autoshard.integrations.lightning``), or the classes
:class:`AutoshardFabricStrategy` / :class:`AutoshardStrategy` to pass options.

Both are Lightning's DDP strategies (process group, launcher, samplers, collectives) with the
model handled by autoshard instead of DDP:

* **Sharding and compiling**: Fabric's ``setup`` / ``setup_module``, and the Trainer's setup
  (after ``configure_model``, before the optimizers are built), shard the module with
  ``autoshard.shard`` and compile it with the autoshard backend (the Trainer compiles the
  LightningModule's ``forward``, which ``training_step`` calls). Do not ``torch.compile``
  the model yourself: Fabric would compile the compiled model again. An optimizer built
  before Fabric's ``setup`` is pointed at the sharded parameters (its state must be empty).
* **Accumulation**: ``fabric.no_backward_sync(model)`` and the Trainer's
  ``accumulate_grad_batches`` call the sharded model's ``no_sync()``: one reduction per step.
* **Checkpoints**: ``fabric.save`` / ``load`` and ``trainer.save_checkpoint`` / ``fit(ckpt_path=)``
  write and read a directory through ``autoshard.save`` / ``autoshard.load`` (each rank its
  shards; loadable at any world size); the rest of the state (Fabric's other entries, the
  Trainer's loops, callbacks and schedulers) is saved as the checkpoint's ``extra``, so it
  must be plain data and tensors.

Lightning is imported here only, so ``import autoshard`` never needs it.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn

from autoshard.runtime.checkpoint import load, save
from autoshard.runtime.errors import UsageError
from autoshard.runtime.shard import is_sharded, shard

NAME = "autoshard"
_NOT_EXTRA = ("state_dict", "optimizer_states")  # the Trainer's checkpoint keys autoshard.save writes itself


def _shard_and_compile(module: nn.Module, shard_kwargs: dict[str, Any], options: dict[str, Any], compile: bool) -> nn.Module:
    if not is_sharded(module):
        shard(module, **shard_kwargs)
    return torch.compile(module, backend="autoshard", options=options) if compile else module


def _unwrap(module: nn.Module) -> nn.Module:
    module = getattr(module, "_forward_module", module)  # Fabric's _FabricModule
    return getattr(module, "_orig_mod", module)  # torch.compile's OptimizedModule


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> ContextManager:
        return _unwrap(module).no_sync() if enabled else nullcontext()


class AutoshardFabricStrategy(FabricDDPStrategy):
    """Fabric's strategy: ``Fabric(strategy=AutoshardFabricStrategy(...))`` or ``strategy="autoshard"``.

    ``shard_kwargs``: keyword arguments of ``autoshard.shard`` (strategy, mixed_precision, ...);
    ``options``: the backend's options; ``compile=False``: train the sharded model uncompiled
    (blocking collectives). Other keyword arguments are Fabric's DDPStrategy's.
    """

    def __init__(self, *args: Any, shard_kwargs: dict[str, Any] | None = None, options: dict[str, Any] | None = None,
                 compile: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shard_kwargs, self._options, self._compile = dict(shard_kwargs or {}), dict(options or {}), compile
        self._backward_sync_control = _NoSync()

    def setup_module(self, module: nn.Module) -> nn.Module:
        return _shard_and_compile(module, self._shard_kwargs, self._options, self._compile)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        # shard replaces the parameters: optimizers built before it are pointed at the new ones, by name.
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        sharded = dict(_unwrap(module).named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            if optimizer.state:
                raise UsageError("AutoshardFabricStrategy: the optimizer has state already; call fabric.setup before "
                                 "its first step (or fabric.setup_module, then build the optimizer).")
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(p)]] if id(p) in names else p for p in group["params"]]
        return module, optimizers, scheduler

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable] | None = None) -> None:
        if storage_options is not None or filter:
            raise UsageError("AutoshardFabricStrategy.save_checkpoint: storage_options and filter are not supported.")
        model, optimizer, extra = _split_state(state)
        save(path, model, optimizer, extra=extra)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:
            raise UsageError("AutoshardFabricStrategy.load_checkpoint: pass the state to restore, e.g. "
                             "fabric.load(path, {'model': model, 'optimizer': optimizer}).")
        model, optimizer, _ = _split_state(state)
        extra = load(path, model, optimizer)
        for key in list(state):
            if not isinstance(state[key], (nn.Module, torch.optim.Optimizer)) and key in extra:
                state[key] = extra.pop(key)
        return extra

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(NAME, cls, description="autoshard: FSDP / ZeRO-3 as a torch.compile backend")


def _split_state(state: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer | None, dict[str, Any]]:
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    optimizers = [getattr(v, "optimizer", v) for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    if len(modules) != 1 or len(optimizers) > 1:
        raise UsageError(f"AutoshardFabricStrategy: a checkpoint holds one model and at most one optimizer; got {len(modules)} "
                         f"and {len(optimizers)}. Save the others with their own fabric.save calls.")
    extra = {k: v for k, v in state.items() if not isinstance(v, (nn.Module, torch.optim.Optimizer))}
    return _unwrap(modules[0]), (optimizers or [None])[0], extra


class AutoshardStrategy(DDPStrategy):
    """The Lightning Trainer's strategy: ``Trainer(strategy=AutoshardStrategy(...))`` or
    ``strategy="autoshard"``; arguments as :class:`AutoshardFabricStrategy`'s."""

    def __init__(self, *args: Any, shard_kwargs: dict[str, Any] | None = None, options: dict[str, Any] | None = None,
                 compile: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shard_kwargs, self._options, self._compile = dict(shard_kwargs or {}), dict(options or {}), compile

    def configure_ddp(self) -> None:
        # Instead of the DDP wrapper: shard the LightningModule (after configure_model) and compile its forward.
        module = self.model
        if not is_sharded(module):
            shard(module, **self._shard_kwargs)
        if self._compile and not getattr(module, "_autoshard_compiled_forward", False):
            module.forward = torch.compile(module.forward, backend="autoshard", options=self._options)
            module._autoshard_compiled_forward = True

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        with self.lightning_module.no_sync():
            yield

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # restored into the sharded model, with its optimizer built

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # autoshard.save writes the shards (save_checkpoint)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    def _optimizer(self) -> torch.optim.Optimizer | None:
        if len(self.optimizers) > 1:
            raise UsageError("AutoshardStrategy: checkpoints hold at most one optimizer; configure_optimizers returned "
                             f"{len(self.optimizers)}.")
        return self.optimizers[0] if self.optimizers else None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        extra = {k: v for k, v in checkpoint.items() if k not in _NOT_EXTRA}
        save(filepath, self.lightning_module, self._optimizer(), extra=extra)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = load(checkpoint_path, self.lightning_module, self._optimizer())
        # Loaded already; the keys stay for Lightning's checks (it refuses a checkpoint without optimizer states).
        return {**checkpoint, "state_dict": {}, "optimizer_states": [{} for _ in self.optimizers]}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded with the optimizer by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            import shutil

            shutil.rmtree(filepath, ignore_errors=True)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(NAME, cls, description="autoshard: FSDP / ZeRO-3 as a torch.compile backend")


# Lightning registers only its own classes: the name "autoshard" works once this module is imported.
for _registry, _cls in ((STRATEGY_REGISTRY, AutoshardFabricStrategy), (StrategyRegistry, AutoshardStrategy)):
    if NAME not in _registry:
        _cls.register_strategies(_registry)
