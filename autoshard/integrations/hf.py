"""Hugging Face ``transformers.Trainer`` with autoshard: replace ``Trainer`` by
:class:`AutoshardTrainer` (``from autoshard.integrations.hf import AutoshardTrainer``).

What it changes in the Trainer, and why (transformers 5.x, accelerate 1.x):

* The model is sharded (``autoshard.shard``) once the Trainer has set up the process group,
  and compiled with the autoshard backend in ``_wrap_model``. Returning the compiled model
  from there makes the Trainer prepare only the optimizer with accelerate, so accelerate
  neither wraps the sharded parameters in DDP (which refuses DTensors) nor compiles again:
  ``TrainingArguments(torch_compile=True)`` only picks autoshard's inner compiler
  (``torch_compile_backend``: "inductor", "aot_eager" or "eager").
* Gradient accumulation: accelerate calls ``model.no_sync()``, which sharded models have
  (autoshard/runtime/sharded.py): one reduction per optimizer step. ``max_grad_norm`` clips
  by the global norm (gradients are DTensors on one mesh).
* ``save_model`` gathers the full weights on every rank and writes them from the main
  process with ``save_pretrained`` (safetensors): ``from_pretrained`` loads them in one process.
* Checkpoints (``save_strategy``): model and optimizer through ``autoshard.save`` in
  ``<checkpoint>/autoshard`` (each rank its shards), loaded by ``autoshard.load`` on resume,
  at any number of ranks; the full weights are written beside them as above.

accelerate and transformers are imported here only, so ``import autoshard`` never needs them.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
import transformers

from autoshard.runtime.checkpoint import full_state_dict, load, save
from autoshard.runtime.errors import UsageError
from autoshard.runtime.shard import is_sharded, shard
from autoshard.runtime.sharded import _base_of

CHECKPOINT_DIR = "autoshard"  # inside each Trainer checkpoint: model and optimizer shards
SCHEDULER_NAME = "scheduler.pt"  # the Trainer's own file name for the scheduler state
_INNER = ("inductor", "aot_eager", "eager")


def _optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


def _name_the_users_class(model: torch.nn.Module, output_dir: str) -> None:
    """save_pretrained records the model's class name, autoshard's sharded subclass
    (``ShardedLlamaForCausalLM``): the config written names the user's class instead."""
    user_class = _base_of.get(type(model), type(model)).__name__
    model.config.architectures = [user_class]
    path = os.path.join(output_dir, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
        config["architectures"] = [user_class]
        with open(path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)


class AutoshardTrainer(transformers.Trainer):
    """``transformers.Trainer`` training the model sharded by autoshard (FSDP / ZeRO-3).

    ``shard_kwargs``: keyword arguments of ``autoshard.shard`` (strategy, mixed_precision, ...),
    ignored when the model is already sharded; ``autoshard_options``: the backend's options
    (``torch.compile(..., options=)``). Every other argument is the Trainer's.
    """

    def __init__(self, *args: Any, shard_kwargs: dict[str, Any] | None = None,
                 autoshard_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # sets up the process group (accelerate's PartialState)
        if self.model is None:
            raise UsageError("AutoshardTrainer: pass model=...; model_init is not supported (the model is sharded once).")
        if not is_sharded(self.model):
            shard(self.model, **(shard_kwargs or {}))
        self._autoshard_options = dict(autoshard_options or {})
        if self.args.torch_compile and "compiler" not in self._autoshard_options:
            backend = self.args.torch_compile_backend or "inductor"
            if backend not in _INNER:
                raise UsageError(f"AutoshardTrainer: torch_compile_backend={backend!r} cannot be autoshard's inner compiler; "
                                 f"use one of {_INNER} (the model is compiled once, with backend='autoshard').")
            self._autoshard_options["compiler"] = backend
        self._autoshard_compiled: torch.nn.Module | None = None

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        # Not self.model: the Trainer then prepares only the optimizer (no DDP, no second compile).
        if self._autoshard_compiled is None:
            self._autoshard_compiled = torch.compile(self.model, backend="autoshard", options=self._autoshard_options)
        return self._autoshard_compiled

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Every rank takes part in the gather; the main process writes (the Trainer's _save returns on the others).
        if state_dict is None:
            state_dict = full_state_dict(self.model)
        if self.args.should_save:
            super()._save(output_dir, state_dict=state_dict)
            _name_the_users_class(self.model, output_dir or self.args.output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save(os.path.join(output_dir, CHECKPOINT_DIR), self.model, _optimizer(self.optimizer))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        # The weights are loaded with the optimizer state (_load_optimizer_and_scheduler), resharded.
        if not os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)):
            raise UsageError(f"AutoshardTrainer: {resume_from_checkpoint} has no {CHECKPOINT_DIR}/ folder; resume from a "
                             "checkpoint an AutoshardTrainer saved (save_strategy='steps' or 'epoch').")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load(os.path.join(checkpoint, CHECKPOINT_DIR), self.model, _optimizer(self.optimizer))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
