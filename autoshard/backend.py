"""The ``autoshard`` torch.compile backend: capture -> lower -> inner compile.

Dynamo hands us the captured graph; AOT autograd builds the joint forward+backward graph, where the annotation ops are lowered
to collectives and gathers are tagged for recompute; the partitioned forward and backward
graphs (min-cut partitioner, which honours the recompute tags) then go to the inner compiler.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.tensor import DTensor

from autoshard.passes import lower_annotations, merge_shared_parameters

from ._compat import (
    aot_autograd,
    compile_fx,
    compile_fx_inner,
    functorch_config,
    make_boxed_func,
    min_cut_rematerialization_partition,
    register_backend,
)
from .dump import GraphDump
from .options import Options, parse_options

_warned_unsharded = False


def _warn_if_unsharded(example_inputs: Sequence[Any]) -> None:
    global _warned_unsharded
    if _warned_unsharded or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if any(isinstance(x, torch.nn.Parameter) and x.requires_grad and not isinstance(x, DTensor) for x in example_inputs):
        _warned_unsharded = True
        warnings.warn(
            "autoshard: the compiled model has trainable parameters that are not sharded, so every "
            "rank keeps a full copy and their gradients are not synchronised. Call "
            "autoshard.shard(model) before torch.compile.",
            stacklevel=2,
        )


def _finish(gm: fx.GraphModule, stage: str, dump: GraphDump) -> fx.GraphModule:
    # A graph compiled without autograd (inference) never went through the joint pass.
    lower_annotations(gm)
    dump.write(stage, gm)
    return gm


def autoshard_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None) -> Callable:
    """Compile a Dynamo graph of a model sharded by :func:`autoshard.shard`."""
    opts: Options = parse_options(options)
    _warn_if_unsharded(example_inputs)
    dump = GraphDump(opts.debug_dir)
    dump.write("captured", gm)
    if opts.compiler == "eager":
        return gm.forward

    def joint_pass(joint: fx.GraphModule, joint_inputs: Any) -> fx.GraphModule:
        dump.write("joint", joint)
        merge_shared_parameters(joint)
        lower_annotations(joint, opts.reshard_after_forward)
        dump.write("lowered", joint)
        return joint

    # The AOT autograd cache would skip joint_pass (and the dumps) on a hit.
    with functorch_config.patch(joint_custom_pass=joint_pass, enable_autograd_cache=False):
        if opts.compiler == "inductor":

            def inner_compile(g: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
                stage = "backward" if kwargs.get("is_backward") else "forward"
                return compile_fx_inner(_finish(g, stage, dump), inputs, **kwargs)

            return compile_fx(gm, example_inputs, inner_compile=inner_compile)

        def compiler(stage: str) -> Callable:
            return lambda g, _inputs: make_boxed_func(_finish(g, stage, dump).forward)

        # No decompositions: aot_eager runs the same ATen kernels as eager, bit for bit.
        return aot_autograd(
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("forward"),
            partition_fn=min_cut_rematerialization_partition,
        )(gm, example_inputs)


register_backend(autoshard_backend, "autoshard")
