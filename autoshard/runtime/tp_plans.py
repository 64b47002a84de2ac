"""Tensor-parallel plans for ``parallelize_module``, to compose with ``autoshard.shard``
(:mod:`autoshard.runtime.tensor_parallel`)::

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], autoshard.transformers_tp_plan(model))
    autoshard.shard(model, mesh["dp"])

Megatron's layout for a transformer block: the projections that fan out (q, k, v; the MLP's
gate and up) are column-parallel, each rank computing its heads and its slice of the hidden
features; the projections that fan back in (attention output, the MLP's down) are
row-parallel, their partial sums all-reduced. Two all-reduces per block in the forward, two in
the backward; norms, embeddings and the head stay replicated over tp (sharded over dp).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from autoshard._compat.dtensor import fused_colwise
from autoshard.runtime.errors import UsageError

__all__ = ["gpt_tp_plan", "transformers_tp_plan"]

# The styles transformers' own plans name (``config.base_model_tp_plan``) that a plain
# ``parallelize_module`` expresses.
_TRANSFORMERS_STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
}


def transformers_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """A ``transformers`` model's own tensor-parallel plan (its config's
    ``base_model_tp_plan``: Llama, Mistral, Qwen2 and others declare one) as a
    ``parallelize_module`` plan, keyed from ``model`` (the base model's prefix added)."""
    config = getattr(model, "config", None)
    declared = getattr(config, "base_model_tp_plan", None)
    if not declared:
        raise UsageError(f"autoshard.transformers_tp_plan: {type(model).__name__}'s config declares no base_model_tp_plan; "
                         "write a parallelize_module plan for it (ColwiseParallel for q/k/v and the MLP's up projections, "
                         "RowwiseParallel for the attention output and the MLP's down projection).")
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or not hasattr(model, prefix):
        prefix = ""  # the base model itself
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in declared.items():
        if style not in _TRANSFORMERS_STYLES:
            raise UsageError(f"autoshard.transformers_tp_plan: {pattern!r} asks for transformers' {style!r} style, which has no "
                             f"parallelize_module equivalent here (known: {sorted(_TRANSFORMERS_STYLES)}); write the plan by hand.")
        plan[f"{prefix}.{pattern}" if prefix else pattern] = _TRANSFORMERS_STYLES[style]()
    return plan


def _linears(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def gpt_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The plan for ``examples/gpt.py``'s GPT: in each attention, the fused ``qkv``
    column-parallel by part (each rank its heads of q, k and v) and ``proj`` row-parallel; in
    each block's MLP, ``fc`` column-parallel and ``out`` row-parallel. Blocks are found by their
    modules wherever they sit (wrapped for activation checkpointing too). The tied embedding and
    head stay replicated over tp. The tp size must divide the number of heads."""
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        at = f"{name}." if name else ""
        if _linears(module, "qkv", "proj"):
            plan.update({f"{at}qkv": fused_colwise(3), f"{at}proj": RowwiseParallel()})
        if hasattr(module, "attn") and _linears(module, "fc", "out"):
            plan.update({f"{at}fc": ColwiseParallel(), f"{at}out": RowwiseParallel()})
    if not plan:
        raise UsageError(f"autoshard.gpt_tp_plan: {type(model).__name__} has no attention with qkv and proj, nor a block with "
                         "attn, fc and out: it is the plan of examples/gpt.py's GPT; write a parallelize_module plan for this model.")
    return plan
