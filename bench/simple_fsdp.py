"""SimpleFSDP (torchtitan's compiler-based FSDP) set up the way torchtitan's graph_trainer sets it up.

Imported by bench/real.py (the measured rows) and bench/overlap.py (its graphs on the cost
model); needs the ``bench`` extra (``pip install -e '.[bench]'``: torchtitan, tyro,
spmd_types, torch_checkpointing, and triton, which torchtitan's graph_trainer passes import
even on CPU). Nothing of torchtitan is copied here: the model is wrapped by
``torchtitan.experiments.graph_trainer.simple_fsdp.data_parallel(mode="fully_shard")`` and
compiled with the backend ``torchtitan.experiments.graph_trainer.jit_backend
.get_compile_backend_with_passes`` builds from a ``GraphTrainerCompileConfig`` (``mode="jit"``,
the ``torch.compile`` path), with one of its two bucketing/reordering passes:

- ``auto_bucketing``: PyTorch's overlap scheduler with collective bucketing
  (``schedule_overlap_bucketing``), on the forward and the backward graph;
- ``transformer_block_bucketing``: PyTorch's manual overlap bucketing with one bucket per
  transformer block, embeddings and the final norm + head each a bucket of their own (what
  ``common_utils.get_transformer_block_buckets`` gives torchtitan's models, written for this GPT's
  module names).

Variants (``VARIANTS``): ``<compiler>`` without a pass, ``<compiler>_auto``, ``<compiler>_block``,
for compiler in ``aot_eager`` and ``inductor``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

VARIANTS = {
    "simplefsdp": ("aot_eager", None),
    "simplefsdp_auto": ("aot_eager", "auto_bucketing"),
    "simplefsdp_block": ("aot_eager", "transformer_block_bucketing"),
    "simplefsdp_inductor": ("inductor", None),
    "simplefsdp_inductor_auto": ("inductor", "auto_bucketing"),
    "simplefsdp_inductor_block": ("inductor", "transformer_block_bucketing"),
}


def missing() -> str | None:
    """Why SimpleFSDP cannot be set up here (one line), or None when it can."""
    try:
        import torchtitan.experiments.graph_trainer.jit_backend  # noqa: F401
        import torchtitan.experiments.graph_trainer.simple_fsdp  # noqa: F401
    except Exception as e:  # ImportError, or an import-time error of torchtitan's own imports
        return f"SimpleFSDP skipped: torchtitan's graph_trainer does not import ({type(e).__name__}: {e}); pip install -e '.[bench]'"
    return None


def block_buckets(model: nn.Module) -> list[list[str] | str]:
    """torchtitan's per-block manual buckets for this GPT: embeddings, [final norm, head], then each
    block (the order and grouping of ``get_transformer_block_buckets``)."""
    return [["wte", "wpe"], ["ln_f", "head"], *(f"blocks.{i}" for i in range(len(model.blocks)))]


def wrap(model: nn.Module, mesh) -> nn.Module:
    """``data_parallel(model, mesh, mode="fully_shard")``, keeping the GPT's tied head.

    data_parallel registers a new DTensor parameter for each (module, name) it meets, so the
    head's weight, tied to the token embedding, would become a second, separately sharded copy
    (the model would then train differently from the others); it is tied again here, to the
    same sharded parameter (SimpleFSDP all-gathers it once per use, as the graph shows)."""
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    tied = getattr(model, "head", None) is not None and model.head.weight is model.wte.weight
    model = data_parallel(model, mesh, mode="fully_shard")
    if tied:
        model.head._parameters["weight"] = model.wte._parameters["weight"]
    return model


def backend(variant: str, model: nn.Module, recorder=None):
    """The torch.compile backend graph_trainer's JIT mode builds for ``variant``.

    ``recorder(stage, gm)``, if given, sees each forward/backward graph after torchtitan's pass
    (aot_eager variants only: with inductor the pass runs inside Inductor's post-grad passes)."""
    from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig
    from torchtitan.experiments.graph_trainer.jit_backend import get_compile_backend_with_passes

    compiler, pass_name = VARIANTS[variant]
    config = GraphTrainerCompileConfig(enable=True, mode="jit", backend=compiler, passes=[pass_name] if pass_name else [])
    torch._inductor.config.reorder_for_peak_memory = False  # as graph_trainer's apply_compile sets it
    compiled = get_compile_backend_with_passes(config, block_buckets(model))
    if recorder is None:
        return compiled
    if compiler != "aot_eager":
        raise ValueError("graphs are recorded for aot_eager variants only")
    return _recording_backend(compiled if pass_name else None, recorder)


def _recording_backend(passes_backend, recorder):
    """aot_eager with torchtitan's pass (taken from ``passes_backend``'s compilers) then ``recorder``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    fw_pass = bw_pass = None
    if passes_backend is not None:  # aot_autograd(...) keeps its kwargs
        fw_pass, bw_pass = passes_backend.kwargs["fw_compiler"], passes_backend.kwargs["bw_compiler"]

    def compiler(stage, pass_):
        def compile_(gm, example_inputs):
            if pass_ is not None:
                gm = pass_(gm, example_inputs)
            recorder(stage, gm)
            return make_boxed_func(gm.forward)
        return compile_

    return aot_autograd(fw_compiler=compiler("forward", fw_pass), bw_compiler=compiler("backward", bw_pass),
                        keep_inference_input_mutations=True)


class _ScaleGrad(torch.autograd.Function):
    """The loss itself forward; its gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, loss, scale):
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def setup(variant: str, model: nn.Module, mesh=None) -> tuple:
    """Wrap and compile ``model`` as ``variant``: returns (callable, module owning the parameters).

    SimpleFSDP reduces gradients as a sum over ranks (``Partial("sum")``: reduce-scatter, no
    average); torchtitan's trainer makes that the global mean by backpropagating the local loss
    divided by the global token count. Here the callable returns the model's (local mean) loss and
    backpropagates it divided by the world size, so its gradients are DDP's and FSDP2's mean (with
    the sum AdamW's steps differ by its eps alone: losses then drift apart by ~1e-5 in 12 steps)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = mesh or init_device_mesh("cpu", (dist.get_world_size(),))
    model = wrap(model, mesh)
    compiled = torch.compile(model, backend=backend(variant, model), fullgraph=True)
    scale = 1.0 / mesh.size()

    def step(*inputs):
        return _ScaleGrad.apply(compiled(*inputs), scale)

    return step, model


@contextlib.contextmanager
def inductor_config_kept() -> Iterator[None]:
    """Undo the global Inductor settings graph_trainer's backend sets (post-grad pass, buffer reuse)."""
    saved = torch._inductor.config.save_config()
    try:
        yield
    finally:
        torch._inductor.config.load_config(saved)


@contextlib.contextmanager
def cpu_estimates(profile: str = "cpu") -> Iterator[None]:
    """Let torchtitan's bucketing passes run on CPU: PyTorch's overlap scheduler, which both call,
    estimates every compute node's roofline time with the GPU's DRAM bandwidth, read through
    triton's GPU driver (``torch._inductor.utils.get_gpu_dram_gbps``), and fails without a GPU
    ("0 active drivers"); and the automatic pass then benchmarks compute nodes with
    ``benchmark_gpu`` ("Torch not compiled with CUDA enabled"). Meanwhile the roofline reads
    ``profile``'s memory bandwidth and peak FLOP/s instead (autoshard's cost-model profile, the
    same figures the simulator plays both systems on) and compute is estimated analytically
    (``aten_distributed_optimizations.compute_estimator="analytical"`` for Inductor's post-grad
    pass; ``schedule_overlap_bucketing``, which the aot_eager pass calls without it, benchmarks:
    its benchmark of a compute node is replaced by the same roofline estimate). Only the estimates the
    passes order and bucket by change: the graphs run as they are."""
    from unittest import mock

    from autoshard.cost.cost_model import get_profile

    figures = get_profile(profile)
    gbps = figures.mem_bandwidth / 1e9

    def tflops(dtype=torch.float32, device=None):  # (device: from torch 2.15)
        name = str(dtype).removeprefix("torch.")
        return figures.peak_flops.get(name, figures.peak_flops["float32"]) / 1e12
    from torch._inductor.fx_passes import overlap_scheduling as scheduling
    from torch.utils import _runtime_estimation as estimation

    # The DRAM bandwidth reader: get_gpu_dram_gbps() up to torch 2.14, get_device_dram_gbps(device) from 2.15.
    dram = "get_gpu_dram_gbps" if hasattr(estimation, "get_gpu_dram_gbps") else "get_device_dram_gbps"

    def roofline(node, custom_runtime_estimation=None):
        return scheduling.estimate_roofline_runtime_ms(node), None

    with (mock.patch.object(estimation, dram, lambda *device: gbps),
          mock.patch("torch.utils._runtime_estimation.get_device_tflops", tflops),
          mock.patch.object(scheduling, "benchmark_node_with_cache_key", roofline),
          torch._inductor.config.patch({"aten_distributed_optimizations.compute_estimator": "analytical"})):
        yield


def fake_step(model_fn, inputs: tuple, world: int, variant: str, profile: str) -> dict:
    """The forward and backward graphs of one SimpleFSDP training step at ``world`` ranks, compiled
    in one process on the fake process group with fake tensors (as bench/overlap.py compiles
    autoshard's), after torchtitan's pass: ``{"forward": gm, "backward": gm, "model": model}``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard._compat import fake_process_group, fake_tensor_mode

    torch._dynamo.reset()
    fake_process_group(0, world)
    graphs: dict = {}
    try:
        mesh = init_device_mesh("cpu", (world,))  # outside fake mode: building a mesh reads real tensors
        with inductor_config_kept(), cpu_estimates(profile), fake_tensor_mode():
            # The automatic pass's bucketer met a dependency cycle on the 125M GPT at 64 fake ranks
            # ("Overlap scheduling: detected 1 cyclic extra dep(s)"); PyTorch's suggested way round it.
            torch._inductor.config.aten_distributed_optimizations.overlap_scheduling_autofix_cycles = True
            model = wrap(model_fn(), mesh)
            compiled = torch.compile(model, backend=backend(variant, model, recorder=graphs.__setitem__), fullgraph=True)
            compiled(*inputs).backward()
    finally:
        dist.destroy_process_group()
    return {**graphs, "model": model}


# --- side by side on fake ranks: `python bench/simple_fsdp.py` (what each system's graphs do)


def _collectives(gm) -> dict[str, int]:
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    out = dict.fromkeys(kinds, 0)
    for n in gm.graph.nodes:  # the collectives themselves (not torch's bucketing ops that prepare their buffers)
        if n.op == "call_function" and str(n.target).startswith("_c10d_functional."):
            out.update((k, out[k] + 1) for k in kinds if k in str(n.target))
    return out


def _autoshard_step(model_fn, inputs: tuple, world: int, profile: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard._compat import fake_process_group, fake_tensor_mode
    from autoshard.compiler.dump import recording

    torch._dynamo.reset()
    fake_process_group(0, world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with fake_tensor_mode(), recording() as graphs:
            model = autoshard.shard(model_fn(), mesh)
            options = {"compiler": "aot_eager", "schedule": "autoshard", "profile": profile}
            torch.compile(model, backend="autoshard", options=options)(*inputs).backward()
    finally:
        dist.destroy_process_group()
    (stages,) = graphs
    return stages


def compare(model_fn, inputs: tuple, world: int, profile: str,
            variants=("simplefsdp", "simplefsdp_auto", "simplefsdp_block")) -> list[dict]:
    """Per system: collectives in its forward and backward graphs, and the simulator's view of them
    (exposed communication, overlap, peak) on ``profile``."""
    from autoshard.cost.simulator import analyze

    rows = []
    for system in ("autoshard", *variants):
        stages = (_autoshard_step(model_fn, inputs, world, profile) if system == "autoshard"
                  else fake_step(model_fn, inputs, world, system, profile))
        a = analyze(stages["forward"], stages["backward"], profile)
        fw, bw = _collectives(stages["forward"]), _collectives(stages["backward"])
        rows.append({"system": system, "fwd_all_gather": fw["all_gather"], "bwd_all_gather": bw["all_gather"],
                     "bwd_reduce_scatter": bw["reduce_scatter"], "all_reduce": fw["all_reduce"] + bw["all_reduce"],
                     "pred_step_ms": a.step_time * 1e3, "exposed_comm_ms": a.exposed_comm * 1e3,
                     "overlap": a.overlap_ratio, "pred_peak_mib": a.peak_bytes / 2**20})
    return rows


def main() -> None:
    import argparse
    import sys
    from pathlib import Path

    from tabulate import tabulate

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from gpt import GPT, GPTConfig

    parser = argparse.ArgumentParser(description="SimpleFSDP's graphs next to autoshard's, on fake ranks")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=96)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--profile", default="cpu")
    args = parser.parse_args()
    if why := missing():
        sys.exit(why)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    idx = torch.zeros(args.batch, args.seq, dtype=torch.long)
    rows = compare(lambda: GPT(cfg), (idx, idx), args.world, args.profile)
    print(f"GPT {args.layers} x {args.embd}, seq {args.seq}, batch {args.batch}; {args.world} fake ranks; "
          f"simulator profile {args.profile}; collectives are op counts in the final forward/backward graphs")
    print(tabulate(rows, headers="keys", floatfmt=".3g"))


if __name__ == "__main__":
    main()
