"""What the Hugging Face Trainer tests run on each rank: a transformers Llama trained by the
Trainer (one process, whole batch) or by AutoshardTrainer (gloo ranks, each its slice)."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import transformers as tf

SEQ, VOCAB, SAMPLES, GLOBAL_BATCH, ACCUMULATION = 16, 211, 32, 4, 2
PROBE = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB


def build() -> tf.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return tf.LlamaForCausalLM(cfg)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(output_dir: str, world: int, **kwargs: Any) -> tf.TrainingArguments:
    given = dict(output_dir=output_dir, per_device_train_batch_size=GLOBAL_BATCH // world, gradient_accumulation_steps=ACCUMULATION,
                 max_steps=4, learning_rate=1e-3, max_grad_norm=0.1, logging_steps=1, save_strategy="no", report_to=[],
                 train_sampling_strategy="sequential", use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, seed=0,
                 disable_tqdm=True)
    return tf.TrainingArguments(**(given | kwargs))


class Recording:
    """Keeps each micro-batch's loss as the Trainer's training_step returns it."""

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.recorded.append(loss.detach().clone())
        return loss


def _step_losses(recorded: list[torch.Tensor]) -> list[float]:
    """Each optimizer step's loss over the whole batch: micro-batches summed, ranks averaged."""
    values = torch.stack(recorded).double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
        values /= dist.get_world_size()
    return values.view(-1, ACCUMULATION).sum(1).tolist()


def _grad_norms(trainer: tf.Trainer) -> list[float]:
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def reference(output_dir: str) -> dict[str, Any]:
    """The plain Trainer in one process (no distributed setup) on the whole batch."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    trainer = type("RecordingTrainer", (Recording, tf.Trainer), {"recorded": []})(
        model=build(), args=arguments(output_dir, 1), train_dataset=dataset())
    trainer.recorded = []
    trainer.train()
    with torch.no_grad():
        logits = trainer.model(input_ids=PROBE).logits
    return {"losses": _step_losses(trainer.recorded), "norms": _grad_norms(trainer), "logits": logits,
            "state": {k: v.clone() for k, v in trainer.model.state_dict().items()}}


def sharded(output_dir: str, resume: str | None = None, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """AutoshardTrainer on this launch's gloo ranks; ``resume``: a checkpoint to continue from;
    ``kwargs``: more TrainingArguments."""
    import autoshard
    from autoshard.integrations.hf import AutoshardTrainer

    world = dist.get_world_size()
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(world), LOCAL_RANK=str(dist.get_rank()),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    trainer = type("RecordingTrainer", (Recording, AutoshardTrainer), {"recorded": []})(
        model=build(), args=arguments(output_dir, world, **(kwargs or {})), train_dataset=dataset())
    trainer.recorded = []
    trainer.train(resume_from_checkpoint=resume)
    wrapped = trainer.model_wrapped
    compiled_once = isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule) and wrapped._orig_mod is trainer.model
    trainer.save_model(os.path.join(output_dir, "final"))
    with torch.no_grad():
        logits = wrapped(input_ids=PROBE).logits
    full = autoshard.full_state_dict(trainer.model)
    return {"losses": _step_losses(trainer.recorded), "norms": _grad_norms(trainer), "logits": logits, "state": full,
            "compiled_once": compiled_once, "ddp": any(isinstance(m, torch.nn.parallel.DistributedDataParallel)
                                                       for m in (wrapped, trainer.model, trainer.model_wrapped))}
