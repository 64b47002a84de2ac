"""What the torchtitan test runs on each rank: torchtitan's Llama 3 debug model trained as
torchtitan's ``Trainer.train_step`` trains it (its config, model code, init, loss divided by the
global count of valid tokens, AdamW, ``clip_grad_norm_``, gradient accumulation), either in one
process on the whole batch, or at several ranks through ``--module autoshard.integrations.torchtitan``.

torchtitan's Trainer itself needs a CUDA-like device (it calls ``torch.cuda.set_device``), so its
step is replayed here with its own components. Two CPU-only changes, the same in both runs:
attention is SDPA instead of FlexAttention (which has no backward on CPU; torchtitan's own
graph_trainer tests swap it the same way), and the mesh is built on "cpu".
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import autoshard

STEPS, ACCUMULATION, GLOBAL_BATCH, SEQ = 4, 2, 4, 32
IGNORE_INDEX = -100


def _config(sharded: bool, compiler: str, name: str) -> Any:
    import importlib

    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if sharded:
        import autoshard.integrations.torchtitan as titan

        config = getattr(titan, name)()  # what --module autoshard.integrations.torchtitan --config <name> loads
    else:
        model = next(m for m in ("llama3", "qwen3", "deepseek_v3") if name.startswith(m + "_"))
        config = getattr(importlib.import_module(f"torchtitan.models.{model}.config_registry"), name)()
        if isinstance(config.loss, ChunkedLossWrapper.Config):
            config.loss = config.loss.loss_fn  # the same loss unchunked (the chunked one backwards itself)
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len = SEQ
    config.training.mixed_precision_param = "float32"  # CPU: parity within 1e-5 needs float32
    config.compile.enable, config.compile.backend = True, compiler  # autoshard's inner compiler
    return config


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's ACCUMULATION micro-batches of the global batch: tokens and labels, some ignored."""
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(ACCUMULATION):
        tokens = torch.randint(0, 2048, (GLOBAL_BATCH, SEQ + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.2] = IGNORE_INDEX  # ranks see unequal token counts
        out.append((tokens[:, :-1], labels))
    return out


def _model(config: Any, sharded: bool) -> torch.nn.Module:
    """As torchtitan's Trainer builds it: on meta, parallelize_fn, to_empty, init_weights."""
    from torchtitan.distributed import ParallelDims, parallel_dims

    world = dist.get_world_size() if dist.is_initialized() else 1
    parallel_dims.device_type = "cpu"  # torchtitan builds its meshes on its device type: cuda by default
    dims = ParallelDims.from_config(config.parallelism, world)
    dims.build_mesh()
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_config.build()
    if sharded:
        model = config.model_spec.parallelize_fn(
            model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
            compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder="")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def train(sharded: bool, compiler: str = "aot_eager", name: str = "llama3_debugmodel", steps: int = STEPS) -> dict[str, Any]:
    from torchtitan.distributed import utils as dist_utils

    config = _config(sharded, compiler, name)
    model = _model(config, sharded)
    loss_fn = config.loss.build(compile_config=None)
    optimizers = config.optimizer.build(model_parts=[model])
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    per_rank = GLOBAL_BATCH // world
    losses, norms = [], []
    for step in range(steps):
        optimizers.zero_grad()
        micro = [(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]) for x, y in _batches(step)]
        local_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro)
        global_tokens = local_tokens.clone()
        if sharded:
            dist.all_reduce(global_tokens)
        step_loss = torch.zeros(())
        for x, y in micro:  # torchtitan's FSDP reduces every micro-batch; so does this
            loss, _ = loss_fn(model(x), y, global_tokens)
            loss.backward()
            step_loss += loss.detach()
        if sharded:
            dist.all_reduce(step_loss)  # each rank's loss is its tokens' share of the global mean
        if step == 0:  # Adam's steps hardly change with the gradients' scale: compare them too
            grads = {n.replace("_checkpoint_wrapped_module.", ""): autoshard.full_tensor(p.grad).clone()
                     for n, p in model.named_parameters()}  # (torchtitan's activation checkpointing wraps blocks)
        norms.append(float(dist_utils.clip_grad_norm_(list(model.parameters()), config.training.max_norm, foreach=True)))
        optimizers.step()
        losses.append(float(step_loss))
    # torchtitan's checkpoints read model.state_dict() (its hooks split the fused QKV weight).
    params = {k: autoshard.full_tensor(v).detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params, "grads": grads, "model": type(model).__name__}
