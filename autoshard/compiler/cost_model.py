"""A first cost model: roofline for compute nodes, ring alpha-beta for collectives.

Works on the final (post-partition) ATen FX graphs, whose nodes carry FakeTensors (or meta
tensors) in ``node.meta["val"]``. Estimates are for one rank, in seconds; they are meant to rank
schedules and buckets against each other, not to predict wall-clock time to the percent.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import fx
from torch.utils.flop_counter import flop_registry

from autoshard._compat import c10d, optimization_hint
from autoshard.passes.graph_utils import (
    COLLECTIVE_KINDS,
    arg,
    collective_kind,
    group_ranks,
    is_exchange,
    is_view,
    is_wait,
    tensor_bytes,
    tensors,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class Link:
    """One interconnect level, as the ring formula of :func:`collective_time` uses it.

    latency: seconds per ring step, per collective kind.
    bandwidth: bus bandwidth (nccl-tests' "busbw") in bytes/s per rank, per collective kind.
    """

    name: str
    latency: dict[str, float] = field(hash=False)
    bandwidth: dict[str, float] = field(hash=False)


@dataclass(frozen=True)
class DeviceProfile:
    """Throughput and latency figures of one device and the links between devices.

    peak_flops: FLOP/s per dtype name ("float32", "bfloat16", ...); unlisted dtypes use float32's.
    mem_bandwidth: device memory bytes/s.
    launch_overhead: seconds added to every compute kernel, so tiny ops are not free.
    op_overhead: seconds every ATen call of the graph costs, views included, when the graph
        runs op by op from Python (aot_eager); 0 where the compiler fuses the graph into kernels.
    ranks_per_node: ranks that share the ``intra`` link; a group spanning several nodes is
        paced by ``inter`` (None: every rank is on one node).
    source: where the figures come from.
    comm_overlap: the share of a collective's time during which compute keeps full speed:
        1 where collectives run on their own engines (GPUs), lower where they take cycles
        from compute (CPU ranks sharing cores with gloo's threads).
    comm_issue_cost: seconds of compute each collective costs its caller besides that share
        (issuing it; on CPU ranks gloo's thread waking and polling on the compute's cores), so
        one more collective is never free while it hides: what a tiny all-gather hidden behind
        matmuls adds to their time, less ``(1 - comm_overlap)`` of its latency. 0 on GPUs.
    comm_workspace: per collective kind, the bytes it allocates besides its input and output
        while in flight (issue to wait), as a fraction of its full buffer; none where absent.
        gloo stages a whole all-gather output and reduce-scatter input (:data:`GLOO_WORKSPACE`).
    comm_input_copied: collective kinds whose backend copies the input when the collective is
        issued and works on the copy (gloo's reduce-scatter reduces a clone, its workspace): the
        input is free from the issue on. Measured on 2 gloo ranks: a 16 MiB reduce-scatter
        input dropped after the issue is freed at once. Elsewhere (NCCL) the collective reads
        its input until it ends.
    comm_release_late: the collective kinds whose buffers may outlive the wait: the memory
        models keep them until the next collective is issued. None on the ``cpu`` profile: gloo
        frees what it holds on its own thread, sometimes well after the wait, but graphs run op
        by op free their collectives' buffers themselves (passes/gloo.py); measured on 2 gloo
        ranks, one plan's peak then repeats (146.1 MiB three times, where it had moved from 146
        to 194 MiB). Inductor's graphs leave them to gloo: the backend then counts
        :data:`GLOO_RELEASE_LATE`.
    fsdp2_blocking: whether FSDP2 eager's collectives block their caller here (gloo on CPU:
        no side streams): its forward then gathers at use, its backward prefetch only gathers
        early, each reduce-scatter ends before the next bucket, and its buffers are freed
        when the call returns. Elsewhere (GPUs) it prefetches the next bucket and keeps one
        reduce-scatter in flight. The default schedule never plans above that peak.
    busy_power_w, idle_power_w: watts one device draws computing, and waiting (on the network);
        None where unknown (then no energy is predicted). See ``StepAnalysis.energy_j``.
    """

    name: str
    # Dicts are excluded from the hash so profiles can still key caches.
    peak_flops: dict[str, float] = field(hash=False)
    mem_bandwidth: float
    launch_overhead: float
    ranks_per_node: int
    intra: Link
    inter: Link | None = None
    source: str = ""
    comm_overlap: float = 1.0
    comm_issue_cost: float = 0.0
    op_overhead: float = 0.0
    comm_workspace: dict[str, float] = field(default_factory=dict, hash=False)
    comm_input_copied: tuple[str, ...] = ()
    comm_release_late: tuple[str, ...] = ()
    fsdp2_blocking: bool = False
    busy_power_w: float | None = None
    idle_power_w: float | None = None

    def fsdp2_policy(self, side: str) -> tuple[int, int]:
        """FSDP2 eager's (prefetch distance, reductions in flight) on ``side`` of the step."""
        if self.fsdp2_blocking:
            return (0 if side == "forward" else 1), 0
        return 1, 1

    def flops_per_s(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for ``dtype`` (the float32 figure for unlisted dtypes)."""
        return self.peak_flops.get(str(dtype).removeprefix("torch."), self.peak_flops["float32"])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> DeviceProfile:
        data = json.loads(text)
        links = {k: Link(**data[k]) if data.get(k) else None for k in ("intra", "inter")}
        late = data.get("comm_release_late", ())
        late = tuple(late) if isinstance(late, (list, tuple)) else ()  # older files: a bool, for what graphs now free
        return DeviceProfile(**{**data, **links, "comm_input_copied": tuple(data.get("comm_input_copied", ())),
                                "comm_release_late": late})


def uniform_link(name: str, latency: float, bandwidth: float) -> Link:
    """A link with the same latency and bus bandwidth for every collective kind."""
    return Link(name, dict.fromkeys(COLLECTIVE_KINDS, latency), dict.fromkeys(COLLECTIVE_KINDS, bandwidth))


def _dgx(name: str, bf16: float, tf32: float, hbm: float, nvlink: Link, infiniband: Link, source: str,
         watts: tuple[float, float]) -> DeviceProfile:
    """A GPU of an 8-GPU DGX node: dense tensor-core peaks (no sparsity; TF32 for float32,
    which training enables for matmuls), ~5 us per kernel launch and scheduling gap;
    ``watts``: (busy, idle) power."""
    return DeviceProfile(
        name=name, peak_flops={"bfloat16": bf16, "float16": bf16, "float32": tf32}, mem_bandwidth=hbm,
        launch_overhead=5e-6, ranks_per_node=8, intra=nvlink, inter=infiniband,
        busy_power_w=watts[0], idle_power_w=watts[1],
        source=f"{source}; nccl-tests PERFORMANCE.md (busbw)",
    )


# gloo's all_gather_into_tensor and reduce_scatter_tensor allocate a temporary as large as the
# full buffer for as long as they run (torch.profiler memory events, 2 CPU ranks, a 16 MiB
# buffer: 16 MiB each; all_reduce works in place). Over gloo the graphs run reduce-scatters as
# all-to-alls (passes/gloo.py): the output they receive into is as large, and the input is read
# until the wait (pipeline.gloo_memory).
GLOO_WORKSPACE = {"all_gather": 1.0, "reduce_scatter": 1.0}
GLOO_INPUT_COPIED = ("reduce_scatter",)  # the staged copy above is a clone of the input
GLOO_RELEASE_LATE = ("all_gather", "reduce_scatter")  # what gloo's thread frees when it gets round to it

PROFILES: dict[str, DeviceProfile] = {
    # NVIDIA H100 SXM5 datasheet: BF16/FP16 989 TFLOP/s, TF32 495 TFLOP/s, HBM3 3.35 TB/s.
    # NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s per direction; nccl-tests reach
    # about 80% of it as bus bandwidth for all-gather and reduce-scatter. DGX H100: one
    # 400 Gb/s ConnectX-7 InfiniBand NIC per GPU = 50 GB/s; ~90% reached. Power: busy at the
    # datasheet's max TDP, 700 W (an upper bound: training rarely holds it). Idle 100 W is an
    # approximation, not a datasheet figure: nvidia-smi commonly reads ~70-100 W on an idle H100
    # SXM; we take the top, a waiting rank stays at P0 with its memory held (140-145 W is read
    # so at 0% utilisation in github.com/wilicc/gpu-burn/issues/114).
    "h100": _dgx("h100", 989e12, 495e12, 3.35e12,
                 uniform_link("nvlink4", latency=2e-6, bandwidth=360e9),
                 uniform_link("infiniband-ndr", latency=5e-6, bandwidth=45e9),
                 "NVIDIA H100 SXM5 datasheet; NVIDIA DGX H100 user guide", watts=(700.0, 100.0)),
    # NVIDIA A100 SXM4 datasheet: BF16/FP16 312 TFLOP/s dense, TF32 156 TFLOP/s, 80 GB HBM2e
    # 2.039 TB/s. NVLink 3: 600 GB/s bidirectional = 300 GB/s per direction; ~80% as bus
    # bandwidth. DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU = 25 GB/s; ~90% reached.
    # Power: busy at the datasheet's max TDP, 400 W; idle 60 W approximates what nvidia-smi
    # commonly reads on an idle A100 SXM4 (~50-60 W), not a datasheet figure.
    "a100": _dgx("a100", 312e12, 156e12, 2.039e12,
                 uniform_link("nvlink3", latency=2e-6, bandwidth=240e9),
                 uniform_link("infiniband-hdr", latency=5e-6, bandwidth=22.5e9),
                 "NVIDIA A100 SXM4 datasheet; NVIDIA DGX A100 user guide", watts=(400.0, 60.0)),
    # The 2-core development machine, gloo over loopback, 2 ranks of 1 thread each: rounded
    # from `python -m autoshard calibrate --world-sizes 2` on a quiet machine (figures move by
    # up to 2x while other jobs share the cores). reduce_scatter is gloo's run as an
    # all-to-all and a mean (passes/gloo.py), scaled from all_gather by the ratio a calibration
    # of that form measured on 2026-12-01 (latency 0.91x, bandwidth 0.93x all_gather's; gloo's
    # own reduce-scatter, an all-reduce of a copy: 1.25x and 0.69x).
    "cpu": DeviceProfile(
        name="cpu",
        peak_flops={"float32": 37e9, "bfloat16": 1.3e9, "float16": 1.6e9},
        mem_bandwidth=9.5e9,
        launch_overhead=0.0,
        op_overhead=7e-6,
        ranks_per_node=1024,
        intra=Link(
            "gloo-loopback",
            latency={"all_gather": 570e-6, "reduce_scatter": 520e-6, "all_reduce": 350e-6},
            bandwidth={"all_gather": 0.42e9, "reduce_scatter": 0.39e9, "all_reduce": 0.83e9},
        ),
        source="measured by python -m autoshard calibrate on the 2-core development VM, 2026-11-29, torch 2.13.0+cpu",
        comm_overlap=0.64,
        # Measured on 2026-12-02 (calibrate's method): a 64-byte all-gather hidden behind 1 ms
        # of matmuls added 0.54-0.74 ms to them, against 0.19-0.52 ms for the all-gather alone.
        comm_issue_cost=450e-6,
        comm_workspace=GLOO_WORKSPACE,
        comm_input_copied=GLOO_INPUT_COPIED,
        fsdp2_blocking=True,
        # No power figures: this VM cannot read its package power, and a guess would only look precise.
    ),
}


def get_profile(name: str | DeviceProfile) -> DeviceProfile:
    """The profile called ``name``, or read from ``name`` if it is a ``.json`` file (as
    ``python -m autoshard calibrate`` writes one), or ``name`` itself if it is a profile."""
    if isinstance(name, DeviceProfile):
        return name
    if name in PROFILES:
        return PROFILES[name]
    if str(name).endswith(".json"):
        try:
            return DeviceProfile.from_json(Path(name).read_text())
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"cannot read device profile {name!r}: {e}; write one with `autoshard calibrate --out {name}`."
            ) from None
    raise ValueError(f"unknown device profile {name!r}; use one of {sorted(PROFILES)} or a .json profile file.")


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
    flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
    # A symbolic count's hint, without adding guards; unbacked counts as 1.
    return optimization_hint(flops, fallback=1) if isinstance(flops, torch.SymInt) else int(flops)


def _compute_dtype(node: fx.Node) -> torch.dtype:
    for inp in node.all_input_nodes:
        value = inp.meta.get("val")
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return torch.float32


# Ops that only allocate (a buffer a collective writes into): no kernel touches the bytes.
_ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)
# Ops that read only the part of their input they copy out (a bucket's copy-out): as many bytes as they write.
_READS_WHAT_IT_WRITES = (torch.ops.aten.narrow_copy.default,)


def node_time(node: fx.Node, profile: str | DeviceProfile) -> float:
    """Seconds one compute node takes:
    ``op_overhead + launch_overhead + max(flops / peak, bytes / mem_bw)``.

    bytes = tensor input bytes + output bytes (a copy-out reading part of its input: twice its
    output bytes); peak is for the dtype of the first floating
    point input. Views, allocations (``empty``) and ATen calls producing no tensor (shape
    arithmetic) launch no kernel and cost only ``op_overhead``. Zero for placeholders, outputs, get_attr, getitem, anything
    that is not an ATen-style OpOverload, and every ``_c10d_functional`` op (costed by
    :func:`collective_time` instead).
    """
    if node.op != "call_function" or not hasattr(node.target, "overloadpacket") or collective_kind(node) or is_wait(node):
        return 0.0  # getitem, builtins, higher-order ops: no ATen call
    profile = get_profile(profile)
    if is_view(node, hidden=True) or node.target in _ALLOCATIONS or not tensors(node.meta.get("val")):
        return profile.op_overhead
    written = tensor_bytes(node.meta.get("val"))
    if node.target in _READS_WHAT_IT_WRITES:
        nbytes = 2 * written
    else:
        nbytes = written + sum(tensor_bytes(arg.meta.get("val")) for arg in _input_nodes(node))
    flop_time = node_flops(node) / profile.flops_per_s(_compute_dtype(node))
    return profile.op_overhead + profile.launch_overhead + max(flop_time, nbytes / profile.mem_bandwidth)


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    # Unlike all_input_nodes, counts an input passed twice twice: the kernel reads it twice.
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


class Collective(NamedTuple):
    """What a collective node moves: its kind, its bytes as :func:`collective_time` counts
    them, its process group's name and the global ranks in that group."""

    kind: str
    nbytes: int
    group: str
    ranks: tuple[int, ...]


def _ring(link: Link, kind: str, steps: int, fraction: float, nbytes: int) -> float:
    return steps * link.latency[kind] + fraction * nbytes / link.bandwidth[kind]


def collective_time(kind: str, nbytes: int, ranks: int | Sequence[int], profile: str | DeviceProfile) -> float:
    """Seconds of one ring collective over ``ranks`` (global ranks, or a group size n meaning
    ranks 0..n-1), in the alpha-beta model behind nccl-tests' bus bandwidth.

    Convention: ``nbytes`` is the FULL buffer: the gathered output of an all-gather, the
    pre-reduce input of a reduce-scatter, the buffer of an all-reduce. all_gather /
    reduce_scatter take ``(n-1) * latency + (n-1)/n * nbytes / busbw``, all_reduce twice that.
    Within one node the intra link sets both terms. A group spanning k nodes is one ring whose
    k node crossings take the inter link's latency and whose bandwidth is the inter link's: the
    slowest hop paces a ring. 0 for one rank.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; valid kinds are {COLLECTIVE_KINDS}.")
    ranks = range(ranks) if isinstance(ranks, int) else ranks
    n = len(ranks)
    if n <= 1:
        return 0.0
    profile = get_profile(profile)
    nodes = len({r // profile.ranks_per_node for r in ranks})
    fraction = (n - 1) / n
    if nodes == 1 or profile.inter is None:
        ring = _ring(profile.intra, kind, n - 1, fraction, nbytes)
    else:
        ring = _ring(profile.intra, kind, n - nodes, 0.0, 0) + _ring(profile.inter, kind, nodes, fraction, nbytes)
    return 2 * ring if kind == "all_reduce" else ring


def _group_size(node: fx.Node) -> int:
    if node.target is c10d.all_to_all_single.default:  # one chunk per rank
        return len(arg(node, "output_split_sizes"))
    return arg(node, "group_size")


def collective_of(node: fx.Node) -> Collective | None:
    """The :class:`Collective` a node runs; None for anything else (including wait_tensor).

    Recognises what :func:`autoshard.passes.graph_utils.collective_kind` does:
    ``_c10d_functional`` ``all_gather_into_tensor`` (and its ``_out`` form),
    ``reduce_scatter_tensor``, ``all_reduce`` and their ``_coalesced`` forms (one collective
    over all their buffers). A group this process does not know (a graph compiled elsewhere)
    counts as ranks 0..size-1 (the op's group size, else the world's).
    """
    kind = collective_kind(node)
    if kind is None:
        return None
    group = arg(node, "group_name")
    # The full buffer: a gather's output, a reduction's input (its first argument).
    nbytes = tensor_bytes(node.meta.get("val") if kind == "all_gather" else fx.node.map_aggregate(node.args[0], _val))
    ranks = group_ranks(group)
    if ranks is None:
        size = None if kind == "all_reduce" else _group_size(node)
        ranks = tuple(range(size or (dist.get_world_size() if dist.is_initialized() else 1)))
    return Collective(kind, nbytes, group, ranks)


def estimators(profile: str | DeviceProfile) -> tuple[Callable[[fx.Node], float], Callable[..., float]]:
    """``(compute_time(node), comm_time(node, nbytes=None))`` in seconds on ``profile``: what
    the scheduling passes take. ``nbytes`` asks for the collective's time at another size."""
    profile = get_profile(profile)

    def compute_time(node: fx.Node) -> float:
        return node_time(node, profile)

    def comm_time(node: fx.Node, nbytes: int | None = None) -> float:
        c = collective_of(node)
        return collective_time(c.kind, c.nbytes if nbytes is None else nbytes, c.ranks, profile)

    return compute_time, comm_time


# The profile's workspace and input copy are what its backend's collectives of each kind do;
# an all-to-all run as a reduce-scatter (passes/gloo.py) has neither: it sends from its input
# and receives into its output.


def workspace(profile: str | DeviceProfile) -> Callable[[fx.Node], int]:
    """``bytes(node)``: what a collective node allocates besides its input and output while in
    flight on ``profile`` (:attr:`DeviceProfile.comm_workspace`); 0 for other nodes."""
    profile = get_profile(profile)

    def workspace_bytes(node: fx.Node) -> int:
        c = collective_of(node)
        return 0 if c is None or is_exchange(node) else int(profile.comm_workspace.get(c.kind, 0.0) * c.nbytes)

    return workspace_bytes


def input_copied(kinds: Collection[str]) -> Callable[[fx.Node], bool]:
    """``copied(node)``: whether a collective node's backend copies its input at the issue,
    for the collective ``kinds`` whose backend does (:attr:`DeviceProfile.comm_input_copied`),
    so the input is free from then on."""
    return lambda node: collective_kind(node) in kinds and not is_exchange(node)
