"""The small graphs the pass tests share: a 3-layer MLP (``Stack``) and a 2-layer one with a
tied weight (``Tied``), compiled at world size 4 on the fake process group, and how the tests
write their nodes (:func:`label`). Notation::

    un(p) / rg(p)    autoshard::unshard / reduce_grad annotation of parameter p
    ag / rs (p+q)    all_gather_into_tensor / reduce_scatter_tensor moving p and q
    ag_out(p)        all_gather_into_tensor_out: the gather of p into a buffer
    a2a(p)           all_to_all_single: p's gradients exchanged, as a reduce-scatter over gloo
    empty / free     a buffer allocated (aten.empty) / its storage freed (resize_storage_bytes_ to 0)
    wait(p+q)        wait_tensor of that collective
    mm  ln  ln_bw  add   matmul (mm, addmm), layer norm forward / backward, add

Parameters are written short: layers.0.weight is 0.w, norm.bias is norm.b.
"""
from __future__ import annotations

import copy
import re
import warnings
from contextlib import nullcontext
from unittest import mock

import torch
import torch.nn.functional as F
from torch import fx, nn

from autoshard._compat import c10d
from autoshard.passes import (
    bucket_collectives,
)
from autoshard.passes.graph_utils import PARAMS, arg, is_op

from fake_pg import compile_step

WORLD = 4
annotations = torch.ops.autoshard
COLLECTIVES = {c10d.all_gather_into_tensor.default: "ag", c10d.all_gather_into_tensor_out.default: "ag_out",
               c10d.reduce_scatter_tensor.default: "rs", c10d.all_to_all_single.default: "a2a"}
COMPUTE = {"mm": "mm", "addmm": "mm", "native_layer_norm": "ln", "native_layer_norm_backward": "ln_bw", "add": "add",
           "empty": "empty", "resize_storage_bytes_": "free"}


class Stack(nn.Module):
    """Three blocks (layers.0-2; the last has 6 rows, uneven over 4 ranks) and a final norm
    outside the blocks, small enough to join the last block's bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 6)])
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(self.norm(x), y)


class Tied(nn.Module):
    """Two linear layers sharing one weight under two names (inp.weight, out.weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(torch.tanh(self.inp(x))), y)


_compiled: dict[tuple, dict[str, fx.GraphModule]] = {}


def stage(model: type[nn.Module], name: str, rank: int = 0, per_use: bool = False) -> fx.GraphModule:
    """A copy of stage ``name`` (``joint``, ``lowered``, ``forward``, ``backward``) of ``model``'s graph,
    compiled once per (model, rank, per_use) with schedule "none" and every parameter resharded
    after forward (the drawings show every block gathered again in backward). ``per_use``: parameters read
    through one annotation op per use, not as ghosts (as by a module compiled without its
    sharded root)."""
    key = (model, rank, per_use)
    if key not in _compiled:
        torch.manual_seed(0)
        reads = mock.patch("autoshard.runtime.leaves.tracing_for_backend", return_value=False) if per_use else nullcontext()
        with reads:
            step = compile_step(model, lambda: (torch.randn(2, 8), torch.randn(2, 8 if model is Tied else 6)),
                                world_size=WORLD, rank=rank, options={"schedule": "none", "reshard_after_forward": True})
        (_compiled[key],) = step.graphs.compiled
    gm = _compiled[key][name]
    with warnings.catch_warnings():  # copying pytree specs warns of a deprecation inside torch
        warnings.simplefilter("ignore", FutureWarning)
        return fx.GraphModule(gm, copy.deepcopy(gm.graph))  # passes work in place; node meta (fake values) is kept


def _short(name: str) -> str:
    return re.sub(r"\.weight$", ".w", re.sub(r"\.bias$", ".b", name.removeprefix("layers.")))


def _params(node: fx.Node) -> str:
    return "+".join(map(_short, node.meta[PARAMS]))


def label(node: fx.Node) -> str | None:
    """The node as the drawings write it; None for nodes they leave out."""
    if node.op != "call_function":
        return None
    if is_op(node, annotations.unshard):
        return f"un({_short(arg(node, 'name'))})"
    if is_op(node, annotations.reduce_grad):
        return f"rg({_short(arg(node, 'name'))})"
    if is_op(node, annotations.unshard_all) or is_op(node, annotations.reduce_all):  # batched: passes/unbatch.py
        return "un_all" if is_op(node, annotations.unshard_all) else "rg_all"
    if node.target in COLLECTIVES:
        return f"{COLLECTIVES[node.target]}({_params(node)})"
    if node.target is c10d.wait_tensor.default:
        return f"wait({_params(arg(node, 'tensor'))})"
    return COMPUTE.get(getattr(node.target, "_opname", None))


def events(gm: fx.GraphModule) -> list[str]:
    return [e for e in map(label, gm.graph.nodes) if e is not None]


def gathers(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]


_POLICIES = {"MUST_RECOMPUTE": "R", "MUST_SAVE": "S"}


def policies(gm: fx.GraphModule) -> list[str]:
    """Each gather with R (MUST_RECOMPUTE: gathered again in backward), S (MUST_SAVE) or - (untagged)."""
    return [f"{label(g)}/{_POLICIES.get(getattr(g.meta.get('recompute'), 'name', None), '-')}" for g in gathers(gm)]


def matmuls_take_one(node: fx.Node) -> float:
    """Compute time: 1 per matmul, nothing else; collective times are in the same unit."""
    return 1.0 if label(node) == "mm" else 0.0


def bucketed(name: str) -> fx.GraphModule:
    """The input schedule_overlap gets in the backend: a partitioned graph after bucketing."""
    return bucket_collectives(stage(Stack, name))
