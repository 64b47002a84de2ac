"""The ``autoshard`` torch.compile backend: capture -> lower -> bucket -> schedule -> inner compile.

Dynamo hands us the captured graph; AOT autograd builds the joint forward+backward graph,
where the annotation ops are lowered to collectives and gathers are tagged for recompute.
The partitioner (min-cut, which honours the tags) splits it; each partitioned graph is then
bucketed and scheduled, checked against the other ranks' plans, and inner-compiled.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.tensor import DTensor

from autoshard._compat import (
    BACKEND_MARK,
    aot_autograd,
    boxed,
    compile_fx,
    compile_fx_inner,
    functorch_config,
    inductor_config,
    min_cut_rematerialization_partition,
    no_python_dispatcher,
    register_backend,
    unlogged_graph_text,
    unset_fake_temporarily,
)
from autoshard._compat.aot import backward_compiled_with_forward
from autoshard._compat.caches import caches_on, keyed_by
from autoshard.compiler import pipeline
from autoshard.compiler.cache_key import cache_key, graph_key
from autoshard.compiler.consistency import keys_agree, reports_compile_failure, retried_when
from autoshard.compiler.dump import GraphDump
from autoshard.compiler.ghosts import gather_ghosts, with_leaves
from autoshard.compiler.logs import CompileLog, log, phase
from autoshard.compiler.options import Options, parse_options
from autoshard.cost.cost_model import DeviceProfile, get_profile, schedule_config
from autoshard.passes.keep import KEPT_BLOCKS
from autoshard.runtime import leaves
from autoshard.runtime.errors import over_budget_in

_warned_unsharded = False

# Inductor settings that would move nodes away from a scheduled order.
KEEP_ORDER = {
    "reorder_for_locality": False,
    "reorder_for_peak_memory": False,
    "reorder_for_compute_comm_overlap": False,
}


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Inside, Python's cycle collector does not run; on exit it runs as before.

    A compile makes hundreds of thousands of objects (graphs, nodes, fake tensors) and frees
    few of them in cycles, so collections find little, yet they scan every object still
    alive: ~1 s of a 48-layer aot_eager compile went to them even with the older objects
    frozen out (gc.freeze). What a compile leaves in cycles waits for the first collection
    after it (+34 MiB, 6%, peak RSS at 48 layers). Nested calls, and processes that turned the
    collector off themselves, are left as they are."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def _one_recompile(gm: fx.GraphModule) -> Iterator[None]:
    """Inside, ``gm.recompile()`` only notes that ``gm``'s code is stale; it is generated once,
    on exit. Each pass that changes the graph recompiles it (so it can run on its own), and
    generating the Python code of a backward graph costs about 0.07 s at 16 layers."""
    stale = []
    gm.recompile = lambda: stale.append(True)  # shadows the method, for this module only
    try:
        yield
    finally:
        del gm.recompile
        if stale:
            gm.recompile()


def _paused(compile_step: Callable) -> Callable:
    @functools.wraps(compile_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        with _collector_paused():
            return compile_step(*args, **kwargs)

    return step


def _warn_if_unsharded(example_inputs: Sequence[Any]) -> None:
    global _warned_unsharded
    if _warned_unsharded or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if any(isinstance(x, torch.nn.Parameter) and x.requires_grad and not isinstance(x, DTensor)
           and not getattr(x, "_autoshard_leaf", False) for x in example_inputs):  # leaves: views of shards
        _warned_unsharded = True
        warnings.warn(
            "autoshard: the compiled model has trainable parameters that are not sharded, so every "
            "rank keeps a full copy and their gradients are not synchronised. Call "
            "autoshard.shard(model) before torch.compile.",
            stacklevel=2,
        )


def _following_requires_grad(compiled: Callable, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """``compiled``, checking first that no parameter's requires_grad changed since Dynamo
    traced ``gm`` (a user may freeze or unfreeze a DTensor parameter at any time, where no
    guard sees it). If one did, the leaves are synced and ``leaves.changes`` counts it, so
    the next call is traced anew, and this call runs ``gm`` eagerly, which reads the new
    setting: no step is ever run with the old one. The same on every rank, since their
    parameters agree."""
    found = leaves.tracked(example_inputs)
    if not found[0] or not isinstance(gm, fx.GraphModule):
        return compiled

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        # Dynamo calls a GraphModule's compiled function with the graph's inputs unboxed.
        return compiled(*args) if not leaves.stale(found) else gm(*args)

    return run


def _profile(gm: fx.GraphModule, opts: Options) -> DeviceProfile:
    if opts.profile is not None:
        return get_profile(opts.profile)
    vals = (n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder"))
    on_cuda = any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in vals)
    return get_profile("h100" if on_cuda else "cpu")


def _param_bytes(example_inputs: Sequence[Any]) -> int:
    # This rank's share of the trainable parameters the graph takes (Dynamo passes them, or
    # their shards' leaves, as inputs; under explain as fake tensors, so not by class).
    trainable = (x for x in example_inputs if isinstance(x, torch.Tensor) and x.requires_grad)
    local = (x.to_local() if isinstance(x, DTensor) else x for x in trainable)
    return sum(t.numel() * t.element_size() for t in local)


@reports_compile_failure
def _finish(
    gm: fx.GraphModule, side: str, dump: GraphDump, compile_log: CompileLog, opts: Options, param_bytes: int, inference: bool = False,
    key_agreed: bool = False,
) -> fx.GraphModule:
    """Run the partitioned pipeline (:data:`autoshard.compiler.pipeline.PARTITIONED`) on one forward or
    backward graph, writing its stages (and the report once the graph's last stage is done)."""
    profile = _profile(gm, opts)
    collectives = pipeline.gloo_memory(profile.comm_release_late, profile.comm_input_copied, opts.compiler)
    ctx = pipeline.Context(opts, side, schedule_config(profile, collectives), param_bytes=param_bytes, key_agreed=key_agreed)
    # Outside the compile's fake mode and Python dispatcher: every torch call in the passes
    # would go through them (a view of a meta tensor: 75x slower). The passes build fake
    # values with their inputs' fake mode.
    with unset_fake_temporarily(), no_python_dispatcher(), phase(f"{side}_passes"):
        pipeline.run(pipeline.PARTITIONED, gm, ctx, compile_log.writing(dump.write))
    compile_log.graph_done(side, gm, ctx.bucket_mb)
    if side == "backward" or inference:
        dump.write_report(profile)
        compile_log.timeline(dump.stages, profile)
    return gm


@_paused
def autoshard_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None) -> Callable:
    """Compile a Dynamo graph of a model sharded by :func:`autoshard.shard`."""
    # First the capture: parameters' ghosts become their shards, gathered (compiler/ghosts.py).
    with phase("capture"):
        inputs, ghosts = gather_ghosts(gm, example_inputs)
    return with_leaves(_following_requires_grad(_compile(gm, inputs, options), gm, inputs), ghosts)


@dataclasses.dataclass
class _Keeping:
    """Across one graph's compiles: how many blocks the joint graph kept gathered beyond the
    first (passes/keep.py, within ``memory_budget_gb``) and the most the next compile may keep.
    The keeping prices the joint graph, the schedule the partitioned graphs; where the schedule
    cannot fit the blocks kept, the graph is compiled again keeping fewer (one fewer, then half
    as many), down to the first block only, whose failure is the budget's own."""

    at_most: int | None = None
    kept: int = 0

    def retried(self, error: BaseException) -> bool:
        return self.kept > 0 and over_budget_in(error) is not None

    def fewer(self) -> None:
        self.at_most = self.kept - 1 if self.at_most is None else self.kept // 2


def _compile(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None) -> Callable:
    opts: Options = parse_options(options)
    _warn_if_unsharded(example_inputs)
    compile_log = CompileLog()  # TORCH_LOGS=autoshard, TORCH_TRACE (compiler/logs.py)
    dump = GraphDump(opts.debug_dir, keep=compile_log.wants_copies())
    write = compile_log.writing(dump.write)
    param_bytes = _param_bytes(example_inputs)
    pipeline.run(pipeline.CAPTURED, gm, pipeline.Context(opts, "captured"), write)
    if opts.compiler == "eager":
        return gm.forward
    keeping = _Keeping()
    while True:
        # Only a budget keeps blocks beyond the first: then the backward compiles with the forward,
        # so an over-budget schedule is found here, where the graph can be compiled again.
        eager_backward = backward_compiled_with_forward() if opts.memory_budget_gb is not None else contextlib.nullcontext()
        try:
            with retried_when(keeping.retried), eager_backward:
                return _compile_once(gm, example_inputs, opts, compile_log, dump, write, param_bytes, keeping)
        except Exception as error:  # Dynamo and Inductor wrap what the passes raise
            if not keeping.retried(error):
                raise
            kept = keeping.kept
            keeping.fewer()
            log.info("the schedule could not fit %d kept blocks in memory_budget_gb; compiling again keeping at most %d",
                     kept, keeping.at_most)


def _compile_once(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: Options, compile_log: CompileLog, dump: GraphDump,
                  write: Callable, param_bytes: int, keeping: _Keeping) -> Callable:
    keeping.kept = 0

    @reports_compile_failure
    def joint_pass(joint: fx.GraphModule, joint_inputs: Any) -> fx.GraphModule:
        with phase("joint_passes"):
            ctx = pipeline.Context(opts, "joint", param_bytes=param_bytes, keep_at_most=keeping.at_most)
            joint = pipeline.run(pipeline.JOINT, joint, ctx, write)
        keeping.kept = joint.meta.get(KEPT_BLOCKS, 0)
        return joint

    # Inductor's caches serve a compile unless its stages are asked for (a hit skips the passes
    # and so their dumps): then the AOT autograd cache is off, as it is for aot_eager anyway.
    cached = opts.compiler == "inductor" and caches_on() and not (opts.debug_dir or compile_log.wants_copies())
    key = cache_key(gm, opts, _profile(gm, opts)) if cached else None
    if key is not None:
        with phase("cache_key"):
            cached = keys_agree(graph_key(gm, example_inputs, key), "captured")
            key = key if cached else None
    with functorch_config.patch(joint_custom_pass=joint_pass, enable_autograd_cache=cached), unlogged_graph_text(), \
            keyed_by(key) if key is not None else contextlib.nullcontext():
        if opts.compiler == "inductor":

            @_paused  # the backward is compiled lazily, outside autoshard_backend
            def inner_compile(g: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
                side = "backward" if kwargs.get("is_backward") else "forward"
                with _one_recompile(g):
                    g = _finish(g, side, dump, compile_log, opts, param_bytes, kwargs.get("is_inference", False), cached)
                if not pipeline.keeps_order(opts.schedule):
                    return compile_fx_inner(g, inputs, **kwargs)
                # Inductor must keep the order the schedule chose.
                with inductor_config.patch(KEEP_ORDER):
                    return compile_fx_inner(g, inputs, **kwargs)

            return compile_fx(gm, example_inputs, inner_compile=inner_compile)

        def compiler(side: str, inference: bool = False) -> Callable:
            @_paused  # the backward is compiled lazily, outside autoshard_backend
            def compile_graph(g: fx.GraphModule, _inputs: Any) -> fx.GraphModule:
                with _one_recompile(g):
                    return boxed(_finish(g, side, dump, compile_log, opts, param_bytes, inference))

            return compile_graph

        # No decompositions: aot_eager runs the same ATen kernels as eager, bit for bit.
        return aot_autograd(
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("forward", inference=True),
            partition_fn=min_cut_rematerialization_partition,
        )(gm, example_inputs)


setattr(autoshard_backend, BACKEND_MARK, True)  # parameters read as ghosts only for it (runtime/leaves.py)
register_backend(autoshard_backend, "autoshard")
