"""What the Lightning tests run on each rank: the tests' GPT trained by Fabric (a hand-written
loop) and by the Lightning Trainer (a LightningModule), in one process on the whole batch
(Lightning's own single-device strategy) or through autoshard's strategies at several ranks."""
from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from launch_env import as_launched
from models import batch, build

STEPS, ACCUMULATION, GLOBAL_BATCH = 4, 2, 4
LR = 0.05


def _data(steps: int = STEPS) -> TensorDataset:
    return TensorDataset(*batch("gpt", 0, steps * ACCUMULATION * GLOBAL_BATCH))


def _world() -> int:
    """This launch's ranks, with the environment Lightning reads to join them (no launcher of its
    own; the group exists already, so Lightning opens no port and any port will do)."""
    return as_launched(29500) if dist.is_initialized() and dist.get_world_size() > 1 else 1


def _mean_over_ranks(values: list[torch.Tensor]) -> list[float]:
    out = torch.stack(values).double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
        out /= dist.get_world_size()
    return out.tolist()  # each micro-batch's loss over its whole (micro-)batch


def _full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import autoshard

    return autoshard.full_state_dict(model, rank0_only=False)


def fabric_train(sharded: bool, save: str | None = None, resume: str | None = None) -> dict[str, Any]:
    """STEPS steps of SGD with ACCUMULATION micro-batches (fabric.no_backward_sync on all but the
    last). ``save``: fabric.save after step 2; ``resume``: fabric.load that and run steps 3-4."""
    world = _world()
    strategy = "auto"
    if sharded:
        import autoshard.integrations.lightning  # noqa: F401  (registers strategy="autoshard")

        strategy = "autoshard"
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()  # joins this launch's ranks (LOCAL_RANK is set): starts no process
    model = build("gpt")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=GLOBAL_BATCH // world, shuffle=False))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    first = 0
    if resume is not None:
        fabric.load(resume, state)
        first = state["step"]
    losses = []
    batches = iter(loader)
    for _ in range(first * ACCUMULATION):
        next(batches)
    for step in range(first, STEPS):
        for micro in range(ACCUMULATION):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATION - 1):
                loss = model(x, y)
                fabric.backward(loss / ACCUMULATION)
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        if save is not None and step == 1:
            state["step"] = step + 1
            fabric.save(save, state)
    params = _full_parameters(model) if sharded else {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": _mean_over_ranks(losses), "params": params, "strategy": type(fabric.strategy).__name__}


class GPTModule(L.LightningModule):
    """The tests' GPT as a LightningModule, built in configure_model; keeps each micro-batch's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net: torch.nn.Module | None = None
        self.losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = build("gpt")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(x, y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(*batch)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def trainer_train(sharded: bool, checkpoint_dir: str, resume: str | None = None) -> dict[str, Any]:
    """Trainer.fit for STEPS steps, accumulate_grad_batches=ACCUMULATION, in epochs of 2 steps;
    ModelCheckpoint saves each epoch's end into ``checkpoint_dir``; ``resume``: fit(ckpt_path=)
    (an epoch's end: Lightning restarts an unfinished epoch from its first batch)."""
    world = _world()
    strategy = "auto"
    if sharded:
        import autoshard.integrations.lightning  # noqa: F401

        strategy = "autoshard"
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoint_dir, every_n_epochs=1, save_on_train_epoch_end=True,
                                                       save_top_k=-1, filename="{step}")
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=ACCUMULATION,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoints],
                        num_sanity_val_steps=0, use_distributed_sampler=False)
    module = GPTModule()
    # Lightning's own distributed sampler shuffles here: each rank takes every world-th sample in order instead.
    data = _data(STEPS // 2)
    sampler = DistributedSampler(data, world, dist.get_rank(), shuffle=False) if world > 1 else None
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler), ckpt_path=resume)
    params = _full_parameters(module) if sharded else {k: v.clone() for k, v in module.state_dict().items()}
    return {"losses": _mean_over_ranks(module.losses), "params": params, "strategy": type(trainer.strategy).__name__,
            "checkpoints": sorted(os.listdir(checkpoint_dir))}
