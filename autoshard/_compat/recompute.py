"""The tags AOT autograd's min-cut partitioner reads on joint-graph nodes (activation
checkpointing's ``CheckpointPolicy``): what the forward saves for the backward and what the
backward recomputes."""
from __future__ import annotations

import operator

import torch
from torch.utils.checkpoint import CheckpointPolicy


def must_recompute(node: torch.fx.Node, graph_id: int) -> None:
    """Tag a joint-graph node so the partitioner recomputes it in backward, never saves it."""
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    node.meta["ac_graph_id"] = graph_id


def must_save(node: torch.fx.Node) -> None:
    """Tag a joint-graph node so the partitioner saves it for backward, never recomputes it."""
    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def recompute_region(node: torch.fx.Node) -> int | None:
    """The region id of a node tagged MUST_RECOMPUTE, else None."""
    return node.meta.get("ac_graph_id") if node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE else None


def save_random_ops_in_checkpoints(joint: torch.fx.GraphModule) -> None:
    """Tag random ops (dropout, scaled_dot_product_attention) inside activation-checkpointed
    regions of a joint graph to be saved, not recomputed.

    Recomputing a random op makes the partitioner save its RNG state for backward, and in
    torch 2.13 it appends those states after the opaque objects the forward saves (a DTensor
    parameter's DeviceMesh, which every sharded model has), breaking AOT autograd's calling
    convention: the forward fails at run time with "expected all
    tensors_saved_with_vc_check to be Tensors". Saving the op's outputs needs no RNG replay
    and is exact; it costs their memory (for attention, the output and log-sum-exp of the
    region, as selective activation checkpointing commonly does).
    """
    recompute = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
    for node in joint.graph.nodes:
        random = node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        if random and node.meta.get("recompute") in recompute:
            # A tuple result is saved through its getitems.
            for saved in [node, *(u for u in node.users if u.target is operator.getitem)]:
                saved.meta["recompute"] = CheckpointPolicy.MUST_SAVE
