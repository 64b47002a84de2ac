"""A first cost model: roofline for compute nodes, ring alpha-beta for collectives.

Works on the final (post-partition) ATen FX graphs, whose nodes carry FakeTensors (or meta
tensors) in ``node.meta["val"]``. Estimates are for one rank, in seconds; they are meant to rank
schedules and buckets against each other, not to predict wall-clock time to the percent.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import fx
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils.flop_counter import flop_registry

from ._compat import c10d, resolve_process_group

aten = torch.ops.aten

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class DeviceProfile:
    """Throughput and latency figures of one device and its process group's links.

    peak_flops: FLOP/s per dtype; dtypes not listed use the float32 entry.
    mem_bandwidth: device memory bytes/s.
    alpha: collective latency per ring step, seconds.
    bandwidth: bytes/s of one rank's link in one direction, as the ring formula uses it.
    launch_overhead: seconds added to every compute kernel, so tiny ops are not free.
    """

    name: str
    # Excluded from the hash (a dict is unhashable) so profiles can still key caches.
    peak_flops: dict[torch.dtype, float] = field(hash=False)
    mem_bandwidth: float
    alpha: float
    bandwidth: float
    launch_overhead: float

    def flops_per_s(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for ``dtype`` (the float32 figure for unlisted dtypes)."""
        return self.peak_flops.get(dtype, self.peak_flops[torch.float32])


PROFILES: dict[str, DeviceProfile] = {
    # One 8-GPU H100 SXM node on NVLink. Public figures (NVIDIA H100 Tensor Core GPU
    # datasheet; NVIDIA Hopper architecture whitepaper), dense (no sparsity):
    #   BF16 / FP16 tensor cores 989 TFLOP/s; TF32 494 TFLOP/s, used for float32 because
    #   PyTorch users enable TF32 matmuls (torch.backends.cuda.matmul.allow_tf32 /
    #   set_float32_matmul_precision("high")); HBM3 3.35 TB/s.
    #   NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s per direction; NCCL reaches
    #   roughly 80% of that as bus bandwidth, so ~360 GB/s effective.
    #   alpha: 2 us per ring step, so (n-1)*alpha = 14 us at 8 GPUs, the order of NCCL's
    #   small-message latency on one NVLink node.
    #   launch_overhead: ~5 us per kernel launch.
    "h100": DeviceProfile(
        name="h100",
        peak_flops={torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494e12},
        mem_bandwidth=3.35e12,
        alpha=2e-6,
        bandwidth=360e9,
        launch_overhead=5e-6,
    ),
    # This development machine: 2 CPU cores, gloo over loopback. Rough guesses, not
    # measurements; a later `calibrate` command will measure them.
    "cpu": DeviceProfile(
        name="cpu",
        peak_flops={torch.bfloat16: 50e9, torch.float16: 50e9, torch.float32: 50e9},
        mem_bandwidth=10e9,
        alpha=50e-6,
        bandwidth=2e9,
        launch_overhead=10e-6,
    ),
}


def get_profile(name: str | DeviceProfile) -> DeviceProfile:
    """The profile called ``name`` (or ``name`` itself if it is a profile); ValueError otherwise."""
    if isinstance(name, DeviceProfile):
        return name
    if name not in PROFILES:
        raise ValueError(f"unknown device profile {name!r}; valid names are {sorted(PROFILES)}.")
    return PROFILES[name]


# The CPU attention kernels that the flop counter's registry lacks, with the formulas of
# their CUDA counterparts (same leading q, k, v / grad_out, q, k, v arguments).
_EXTRA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ],
}


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _int(x: Any) -> int:
    # A symbolic size's hint, without adding guards; unbacked sizes count as 1.
    return optimization_hint(x, fallback=1) if isinstance(x, torch.SymInt) else int(x)


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or nested lists/tuples); others count 0.

    numel x element size: the bytes a kernel reads or writes, whatever the strides.
    """
    return sum(_int(t.numel()) * t.element_size() for t in _tensors(value))


def is_alias(node: fx.Node) -> bool:
    """Whether ``node`` only makes a new view of its first input's storage.

    ``_unsafe_view`` is a view whose schema hides the alias (for autograd's sake).
    """
    target = node.target
    return node.op == "call_function" and (getattr(target, "is_view", False) or target is aten._unsafe_view.default)


def _is_c10d(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional"


def node_flops(node: fx.Node) -> int:
    """FLOPs of one call, by ``torch.utils.flop_counter``'s formulas on the fake values.

    Ops without a formula (elementwise, reductions, copies) count 0: the roofline makes
    them memory-bound, which they are.
    """
    packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None
    formula = flop_registry.get(packet) or _EXTRA_FLOP_FORMULAS.get(packet)
    if formula is None:
        return 0
    args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), _val)
    return _int(formula(*args, **kwargs, out_val=node.meta.get("val")))


def _compute_dtype(node: fx.Node) -> torch.dtype:
    for arg in node.all_input_nodes:
        value = arg.meta.get("val")
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return torch.float32


def node_time(node: fx.Node, profile: str | DeviceProfile) -> float:
    """Seconds one compute node takes: ``launch_overhead + max(flops / peak, bytes / mem_bw)``.

    bytes = tensor input bytes + output bytes; peak is for the dtype of the first floating
    point input. Zero for placeholders, outputs, get_attr, getitem, views (they allocate and
    move nothing), nodes producing no tensor (shape arithmetic), anything that is not an
    ATen-style OpOverload, and every ``_c10d_functional`` op (costed by
    :func:`collective_time` instead).
    """
    if (
        node.op != "call_function"
        or not hasattr(node.target, "overloadpacket")  # getitem, builtins, higher-order ops
        or is_alias(node)
        or _is_c10d(node)
        or not _tensors(node.meta.get("val"))
    ):
        return 0.0
    profile = get_profile(profile)
    nbytes = tensor_bytes(node.meta.get("val")) + sum(tensor_bytes(arg.meta.get("val")) for arg in _input_nodes(node))
    flop_time = node_flops(node) / profile.flops_per_s(_compute_dtype(node))
    return profile.launch_overhead + max(flop_time, nbytes / profile.mem_bandwidth)


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    # Unlike all_input_nodes, counts an input passed twice twice: the kernel reads it twice.
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def collective_time(kind: str, nbytes: int, group_size: int, profile: str | DeviceProfile) -> float:
    """Seconds of one ring collective under the alpha-beta model.

    Convention: ``nbytes`` is the FULL buffer: the gathered output of an all-gather, the
    pre-reduce input of a reduce-scatter, the buffer of an all-reduce. Then
    all_gather / reduce_scatter take ``(n-1) * alpha + (n-1)/n * nbytes / bandwidth``
    and all_reduce (a reduce-scatter then an all-gather) twice that. 0 for one rank.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; valid kinds are {COLLECTIVE_KINDS}.")
    if group_size <= 1:
        return 0.0
    profile = get_profile(profile)
    steps = group_size - 1
    ring = steps * profile.alpha + steps / group_size * nbytes / profile.bandwidth
    return 2 * ring if kind == "all_reduce" else ring


def _group_size(group_name: str) -> int:
    if not dist.is_initialized():
        return 1
    try:
        return resolve_process_group(group_name).size()
    except RuntimeError:  # a group this process does not know (e.g. a graph from elsewhere)
        return dist.get_world_size()


def collective_of(node: fx.Node) -> tuple[str, int, int] | None:
    """``(kind, nbytes, group_size)`` of a collective node, with nbytes as in
    :func:`collective_time`; None for anything else (including wait_tensor).

    Recognises ``_c10d_functional`` ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
    ``all_reduce`` and their ``_coalesced`` forms (one collective over all their buffers).
    all_reduce's group size comes from the named process group, else the world size, else 1.
    """
    if node.op != "call_function":
        return None
    target, args = node.target, node.args
    if target in (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_coalesced.default):
        return "all_gather", tensor_bytes(node.meta.get("val")), args[1]
    if target in (c10d.reduce_scatter_tensor.default, c10d.reduce_scatter_tensor_coalesced.default):
        return "reduce_scatter", tensor_bytes(fx.node.map_aggregate(args[0], _val)), args[2]
    if target in (c10d.all_reduce.default, c10d.all_reduce_coalesced.default):
        return "all_reduce", tensor_bytes(fx.node.map_aggregate(args[0], _val)), _group_size(args[2])
    return None


def estimators(profile: str | DeviceProfile) -> tuple[Callable[[fx.Node], float], Callable[..., float]]:
    """``(compute_time(node), comm_time(node, nbytes=None))`` in seconds on ``profile``: what
    the scheduling passes take. ``nbytes`` asks for the collective's time at another size."""
    profile = get_profile(profile)

    def compute_time(node: fx.Node) -> float:
        return node_time(node, profile)

    def comm_time(node: fx.Node, nbytes: int | None = None) -> float:
        kind, size, group = collective_of(node)
        return collective_time(kind, size if nbytes is None else nbytes, group, profile)

    return compute_time, comm_time
