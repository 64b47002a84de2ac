"""Expert parallelism's ops: tokens travel to the rank owning their expert, and back.

``autoshard::expert_parallel(hidden [T, H], top_k_index [T, k], weights, key, group_name,
world_size) -> [T, k, H]``: each token's output from each of its ``k`` experts, before the
router's weighting (which the caller applies in plain torch ops, so autograd gives the router
its gradient). ``weights`` are this rank's experts only (``[E / world_size, ...]`` each);
expert ``e`` lives on rank ``e // (E / world_size)``. Every shape at the op's boundary is
static; inside, eagerly, the sizes follow the routing (dropless): count the tokens for each
expert, exchange the counts, ``all_to_all_single`` the tokens with those splits, run the local
experts, send the outputs back. A compiled graph holds one opaque call per MoE layer, whatever
the routing: no graph break, no recompile per batch.

Its backward, ``autoshard::expert_parallel_backward``, sends each token (again) together with
its output gradient to the expert's owner (one exchange), recomputes the local experts there
under autograd, and sends the input gradients back. Expert gradients are divided by
``world_size``: each rank's loss is the mean over its slice and dense gradients are averaged
over ranks, so the experts' gradients, summed over every rank's tokens, take the same 1/N.

How a rank runs its local experts is registered under ``key`` (:func:`register`): the experts
module's own forward on its local shard, so the experts' math stays the model's.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from autoshard._compat import autograd_inside_op, resolve_process_group

# key -> run(tokens [R, H], local expert of each [R], weights) -> outputs [R, H]
LocalExperts = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]], torch.Tensor]
_LOCAL: dict[str, LocalExperts] = {}


def register(key: str, run: LocalExperts) -> None:
    """Name how this rank runs its local experts (the same ``key`` on every rank)."""
    _LOCAL[key] = run


class _Route(NamedTuple):
    order: torch.Tensor  # [T*k]: (token, slot) pairs sorted by expert, so by destination rank
    send: list[int]  # rows sent to each rank
    recv: list[int]  # rows received from each rank
    local_expert: torch.Tensor  # [sum(recv)]: which local expert each received row is for


def _route(top_k_index: torch.Tensor, experts: int, world_size: int, group: dist.ProcessGroup) -> _Route:
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    per_rank = experts // world_size
    counts = torch.bincount(flat, minlength=experts).view(world_size, per_rank)  # [dest rank, its local expert]
    received = torch.empty_like(counts)  # [source rank, my local expert]
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    # Rows arrive grouped by source rank, each source's sorted by expert.
    local_expert = torch.repeat_interleave(torch.arange(per_rank).repeat(world_size), received.reshape(-1))
    return _Route(order, counts.sum(1).tolist(), received.sum(1).tolist(), local_expert)


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def _experts_of(weights: list[torch.Tensor], world_size: int) -> int:
    return weights[0].shape[0] * world_size


@torch.library.custom_op("autoshard::expert_parallel", mutates_args=())
def expert_parallel(hidden: torch.Tensor, top_k_index: torch.Tensor, weights: list[torch.Tensor], key: str,
                    group_name: str, world_size: int) -> torch.Tensor:
    group = resolve_process_group(group_name)
    tokens, k = top_k_index.shape
    route = _route(top_k_index, _experts_of(weights, world_size), world_size, group)
    received = _exchange(hidden[route.order // k], route.send, route.recv, group)
    with torch.no_grad():
        done = _LOCAL[key](received, route.local_expert, weights).to(hidden.dtype)
    back = _exchange(done, route.recv, route.send, group)
    out = hidden.new_empty((tokens * k, hidden.shape[1]))
    out[route.order] = back
    return out.view(tokens, k, hidden.shape[1])


@expert_parallel.register_fake
def _(hidden, top_k_index, weights, key, group_name, world_size):
    return hidden.new_empty((top_k_index.shape[0], top_k_index.shape[1], hidden.shape[1]))


@torch.library.custom_op("autoshard::expert_parallel_backward", mutates_args=())
def expert_parallel_backward(grad: torch.Tensor, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: list[torch.Tensor],
                             key: str, group_name: str, world_size: int) -> list[torch.Tensor]:
    group = resolve_process_group(group_name)
    tokens, k = top_k_index.shape
    width = hidden.shape[1]
    route = _route(top_k_index, _experts_of(weights, world_size), world_size, group)
    pairs = torch.cat([hidden[route.order // k], grad.reshape(tokens * k, width)[route.order].to(hidden.dtype)], dim=1)
    received = _exchange(pairs, route.send, route.recv, group)
    with autograd_inside_op():
        x = received[:, :width].detach().requires_grad_(True)
        ws = [w.detach().requires_grad_(True) for w in weights]
        y = _LOCAL[key](x, route.local_expert, ws)
        grads = torch.autograd.grad(y, [x, *ws], received[:, width:].to(y.dtype), allow_unused=True)
    grad_x = grads[0] if grads[0] is not None else torch.zeros_like(x)
    back = _exchange(grad_x.to(hidden.dtype), route.recv, route.send, group)
    grad_hidden = torch.zeros_like(hidden).index_add_(0, route.order // k, back)
    grad_weights = [torch.zeros_like(w) if g is None else g.div_(world_size) for w, g in zip(weights, grads[1:])]  # fresh: in place
    return [grad_hidden, *grad_weights]


@expert_parallel_backward.register_fake
def _(grad, hidden, top_k_index, weights, key, group_name, world_size):
    return [torch.empty_like(hidden), *(torch.empty_like(w) for w in weights)]


def _setup(ctx, inputs, output) -> None:
    hidden, top_k_index, weights, key, group_name, world_size = inputs
    ctx.save_for_backward(hidden, top_k_index, *weights)
    ctx.args = (key, group_name, world_size)


def _backward(ctx, grad):
    hidden, top_k_index, *weights = ctx.saved_tensors
    grads = expert_parallel_backward(grad, hidden, top_k_index, weights, *ctx.args)
    return grads[0], None, grads[1:], None, None, None


expert_parallel.register_autograd(_backward, setup_context=_setup)

EXPERT_PARALLEL = torch.ops.autoshard.expert_parallel.default
EXPERT_PARALLEL_BACKWARD = torch.ops.autoshard.expert_parallel_backward.default
