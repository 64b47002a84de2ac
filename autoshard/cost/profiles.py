"""Device profiles: the throughput, latency and memory figures of one device and the links
between devices, as the cost model (:mod:`autoshard.cost.cost_model`) prices graphs with
them; the built-in profiles (:data:`PROFILES`) and how one is written to and read from JSON."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import torch

from autoshard.passes.graph_utils import COLLECTIVE_KINDS
from autoshard.passes.schedule_config import ProfileFigures


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
class DeviceProfile(ProfileFigures):
    """Throughput and latency figures of one device and the links between devices; the
    figures scheduling reads too (``comm_overlap``, ``comm_issue_cost``, ``fsdp2_blocking``,
    ...) are declared in :class:`ProfileFigures` (``passes/schedule_config.py``), which the
    cost model hands the passes whole (``cost_model.schedule_config``).

    peak_flops: FLOP/s per dtype name ("float32", "bfloat16", ...); unlisted dtypes use float32's.
    mem_bandwidth: device memory bytes/s.
    launch_overhead: seconds added to every compute kernel, so tiny ops are not free.
    op_overhead: seconds every ATen call of the graph costs, views included, when the graph
        runs op by op from Python (aot_eager); 0 where the compiler fuses the graph into kernels.
    ranks_per_node: ranks that share the ``intra`` link; a group spanning several nodes is
        paced by ``inter`` (None: every rank is on one node).
    source: where the figures come from.
    comm_workspace: per collective kind, the bytes it allocates besides its input and output
        while in flight (issue to wait), as a fraction of its full buffer; none where absent.
        gloo stages a whole all-gather output and reduce-scatter input (:data:`GLOO_WORKSPACE`).
    comm_input_copied: collective kinds whose backend copies the input when the collective is
        issued and works on the copy (gloo's reduce-scatter reduces a clone, its workspace): the
        input is free from the issue on (measured: bench/gloo_memory.py). Elsewhere (NCCL) the
        collective reads its input until it ends.
    comm_release_late: the collective kinds whose buffers may outlive the wait: the memory
        models keep them until the next collective is issued. None on the ``cpu`` profile: gloo
        frees what it holds on its own thread, sometimes well after the wait, but graphs run op
        by op free their collectives' buffers themselves (passes/gloo.py), which made measured
        peaks repeat (docs/design.md, the cpu profile's figures). Inductor's graphs leave them
        to gloo: the backend then counts :data:`GLOO_RELEASE_LATE`.
    busy_power_w, idle_power_w: watts one device draws computing, and waiting (on the network);
        None where unknown (then no energy is predicted). See ``StepAnalysis.energy_j``.
    matmul_efficiency: the fraction of ``peak_flops`` that compute-bound kernels reach (a
        measured matmul ceiling over the datasheet peak; 1.0: the peak itself). The roofline
        prices FLOPs at ``flops_per_s``, the peak times this.
    attention_efficiency: the fraction of the peak a fused attention kernel reaches on the
        FLOPs it does, a causal one doing half the square the flop counter counts (None:
        attention priced as any other FLOPs, whole square at ``matmul_efficiency``).
    nic_per_rank: whether every rank of a node has its own NIC (``inter`` is one NIC's
        figures): a ring across nodes then runs one channel per NIC, the ranks a group has on
        each node crossing between nodes in parallel (NCCL's rings, one per NIC). False: one
        ``inter`` link paces the whole ring.
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
    op_overhead: float = 0.0
    comm_workspace: dict[str, float] = field(default_factory=dict, hash=False)
    comm_input_copied: tuple[str, ...] = ()
    comm_release_late: tuple[str, ...] = ()
    busy_power_w: float | None = None
    idle_power_w: float | None = None
    matmul_efficiency: float = 1.0
    attention_efficiency: float | None = None
    nic_per_rank: bool = False

    def peak_flops_per_s(self, dtype: torch.dtype) -> float:
        """Datasheet peak FLOP/s for ``dtype`` (the float32 figure for unlisted dtypes)."""
        return self.peak_flops.get(str(dtype).removeprefix("torch."), self.peak_flops["float32"])

    def flops_per_s(self, dtype: torch.dtype) -> float:
        """FLOP/s compute-bound kernels reach for ``dtype``: its peak times ``matmul_efficiency``."""
        return self.matmul_efficiency * self.peak_flops_per_s(dtype)

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
# full buffer for as long as they run; all_reduce works in place (bench/gloo_memory.py measures
# it; the figures: docs/design.md, "Where the cpu profile's figures come from"). Over gloo the
# graphs run reduce-scatters as all-to-alls (passes/gloo.py): the output they receive into is
# as large, and the input is read until the wait (pipeline.gloo_memory).
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
    # The machine of torchtitan's published Llama 3 runs (benchmarks/llama3_h100_202412_torchtitan.md,
    # "Hardware"): Grand Teton hosts of 8 H100 "fully connected with NVLink", 96 GB HBM2e at
    # "2.4 TB/sec peak memory bandwidth", "400 Gb/s per GPU" RDMA between hosts, a 500 W power
    # limit. Its footnote 2: the peak FLOP/s of this HBM2e, lower-TDP H100 lie "between SXM and
    # NVL" (dense BF16: SXM5 989 TFLOP/s, H100 NVL datasheet 1,671 with sparsity = 835; TF32 495
    # and 418): we take the middle, 912 and 456 (+-8% either way). Matmuls reach 80.1% of the
    # peak: 792.1 of 989 TFLOP/s measured on H100 SXM by the maximum achievable matmul FLOPS
    # finder (github.com/stas00/ml-engineering, compute/accelerator, "MAMF" table, CUDA 12.1).
    # Attention: PyTorch's SDPA flash kernel in December 2024 was FlashAttention-2, which reaches
    # "only 35% utilization on H100 GPUs" (FlashAttention-3 paper, arXiv 2407.08608, abstract).
    # Links as the h100 profile's: NVLink 4 at 80% of 450 GB/s per direction, one NIC per GPU at
    # 90% of 50 GB/s, ~2 and ~5 us per ring step; every GPU's NIC carries its own ring channel.
    # Busy power: the stated 500 W limit; idle as the h100 profile's (an approximation).
    "h100_grand_teton": replace(
        _dgx("h100_grand_teton", 912e12, 456e12, 2.4e12,
             uniform_link("nvlink4", latency=2e-6, bandwidth=360e9),
             uniform_link("roce-400g", latency=5e-6, bandwidth=45e9),
             "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton); NVIDIA H100 SXM5 and NVL datasheets; "
             "ml-engineering MAMF table; FlashAttention-3 paper", watts=(500.0, 100.0)),
        matmul_efficiency=0.801, attention_efficiency=0.35, nic_per_rank=True),
    # The 2-core development machine, gloo over loopback, 2 ranks of 1 thread each: rounded
    # from `python -m autoshard calibrate`. reduce_scatter is gloo's run as an all-to-all and a
    # mean (passes/gloo.py), so it is all_gather's scaled by the ratio calibrate measures for
    # that form. The measurements, dated, with their commands: docs/design.md, "Where the cpu
    # profile's figures come from".
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
        # What a tiny all-gather behind matmuls adds to them beyond its own time (calibrate's
        # method; the measurement in docs/design.md).
        comm_issue_cost=450e-6,
        comm_workspace=GLOO_WORKSPACE,
        comm_input_copied=GLOO_INPUT_COPIED,
        fsdp2_blocking=True,
        # No power figures: this VM cannot read its package power, and a guess would only look precise.
    ),
}
