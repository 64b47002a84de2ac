"""``autoshard.explain``: run the whole pipeline on one process, without a cluster or memory
for weights, and report what the backend did (:class:`autoshard.tools.report.report.Report`).

    report = autoshard.explain(build_model, tokens, tokens, world_size=64)
    print(report.summary()); report.save_html("gpt.html")

The model is built and run under a FakeTensorMode on the fake process group: tensors carry
shapes and dtypes but no data, collectives are shape-correct no-ops, so an 8B-parameter model
at 1024 ranks compiles on a laptop. Also the ``autoshard explain`` command (:func:`run`).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autoshard._compat import fake_process_group, fake_tensor_mode, tree_leaves
from autoshard.compiler.dump import recording
from autoshard.compiler.options import SCHEDULES, parse_options
from autoshard.cost.cluster import Cluster
from autoshard.runtime.errors import UsageError, UsageTypeError
from autoshard.runtime.shard import is_sharded, shard
from autoshard.tools.plan.shares import best_split
from autoshard.tools.report.report import Report

ModelOrFactory = nn.Module | Callable[[], nn.Module]


def explain(
    model_or_factory: ModelOrFactory, *example_args: Any, world_size: int = 8, profile: str = "h100",
    stages: Collection[str] | None = None, cluster: Cluster | None = None, **options: Any,
) -> Report:
    """The :class:`Report` of compiling one training step of a model with the autoshard
    backend at ``world_size`` ranks (this process plays rank 0).

    Args:
        model_or_factory: a callable returning the model (called inside the fake mode, so its
            weights take no memory: pass a factory for big models), or a small module, which
            is deep-copied first and left unchanged. The factory may shard the model itself
            (``autoshard.shard(model)`` sees the fake world), with any strategy and a mesh it
            builds with ``init_device_mesh``; otherwise explain shards it (strategy "full").
        example_args: the model's inputs; tensors count by shape, dtype and device only
            (fake zeros of the same take their place), other values are passed as they are.
        world_size: ranks of the simulated world.
        profile: the cost model's device profile ("h100", "a100", "cpu" or a .json file),
            for the backend's scheduling decisions and for the simulated step; None: the
            backend's default for the inputs' device ("cpu" for CPU tensors).
        stages: the stages the report keeps (e.g. ``("captured", "forward", "backward")``, all
            its metrics need); None: every stage (copying one of a large graph takes seconds).
        cluster: a mixed :class:`~autoshard.cost.cluster.Cluster`: compiled at its size on its
            slowest profile (they replace ``world_size`` and ``profile``), then played with every
            rank type on its own profile and planned batch share (:attr:`Report.mixed_cluster_step`, in the summary).
        options: any other backend option (``schedule``, ``bucket_mb``, ...); ``compiler``
            defaults to "aot_eager": the graphs as the backend hands them to the inner compiler
            (Inductor's decompositions would change the ATen ops, not the collectives).

    The output is summed and backpropagated when it requires grad (a training step);
    otherwise the report holds the inference graph (no backward). Requires that no process
    group is initialised (explain brings up and destroys its own fake one and resets Dynamo
    before and after); raises UsageError when Dynamo split the model into several graphs
    (graph breaks): :func:`explain_graphs` returns a report per graph.
    """
    if cluster is not None:
        if not isinstance(cluster, Cluster):
            raise UsageError(f"autoshard.explain: cluster must be an autoshard.Cluster, got {type(cluster).__name__}.")
        world_size, profile = cluster.world_size, cluster.as_slowest()
    reports = _explain(model_or_factory, lambda _model: example_args, world_size, profile, options, stages)
    if cluster is not None:
        for report in reports:
            report.mixed_cluster_step = best_split(report.simulation, cluster, 0, None)
    if len(reports) != 1:
        raise UsageError(
            f"autoshard.explain: Dynamo compiled {len(reports)} graphs (graph breaks); use autoshard.explain_graphs, which "
            "returns one report per graph, or remove the graph breaks."
        )
    return reports[0]


def explain_graphs(
    model_or_factory: ModelOrFactory, *example_args: Any, world_size: int = 8, profile: str = "h100", **options: Any
) -> list[Report]:
    """As :func:`explain`, one :class:`Report` per graph Dynamo compiled, in compile order."""
    return _explain(model_or_factory, lambda _model: example_args, world_size, profile, options)


def _fake_like(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    device = "cpu" if value.device.type == "meta" else value.device
    return torch.zeros(value.shape, dtype=value.dtype, device=device).requires_grad_(value.requires_grad)


def _explain(
    model_or_factory: ModelOrFactory,
    make_args: Callable[[nn.Module], Sequence[Any]],
    world_size: int,
    profile: str,
    options: dict[str, Any],
    stages: Collection[str] | None = None,
) -> list[Report]:
    """:func:`explain_graphs` with the example inputs made from the built model (the CLI
    reads a GPT's block size from it); reports of ``stages`` only (None: every stage)."""
    if dist.is_initialized():
        raise UsageError(
            "autoshard.explain: a process group is initialised, but explain runs on its own fake process group; call it before "
            "init_process_group or after destroy_process_group."
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"autoshard.explain: world_size must be a positive int, got {world_size!r}; pass e.g. world_size=8 "
                         "(--world-size 8 on the command line).")
    # On CPU inputs the backend's default profile is "cpu"; the report must use the same.
    options = {"compiler": "aot_eager", "profile": profile or "cpu", **options}
    parse_options(options)  # bad options fail here, before anything is built
    if options["compiler"] == "inductor":  # its C++ kernels read the fake tensors' (absent) data: a segfault
        raise UsageError("autoshard.explain: compiler 'inductor' cannot run on the fake tensors explain steps with; "
                         "leave compiler at 'aot_eager' (the same collectives, buckets and schedule: Inductor changes only "
                         "the ATen ops) or compile for real ranks with torch.compile(model, backend='autoshard').")
    module = None
    if isinstance(model_or_factory, nn.Module):
        if is_sharded(model_or_factory):
            raise UsageError("autoshard.explain: the module is already sharded; pass a factory that builds (and may shard) it instead.")
        module = copy.deepcopy(model_or_factory)  # shard() works in place; the caller's module stays as is
    elif not callable(model_or_factory):
        raise UsageTypeError(f"autoshard.explain: expected an nn.Module or a callable returning one, "
                             f"got {type(model_or_factory).__name__}; pass the model or a function that builds it.")

    torch.compiler.reset()  # graphs cached for another world would be reused otherwise
    fake_process_group(0, world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))  # outside fake mode: building a mesh reads real tensors
        with fake_tensor_mode(), recording(stages) as graphs:
            model = module if module is not None else model_or_factory()
            if not isinstance(model, nn.Module):
                raise UsageTypeError(f"autoshard.explain: the factory returned {type(model).__name__}, not an nn.Module; "
                                     "make it return the model.")
            args = [_fake_like(a) for a in make_args(model)]  # before shard: errors name the user's class
            if not is_sharded(model):
                shard(model, mesh)
            out = torch.compile(model, backend="autoshard", options=options)(*args)
            trainable = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if trainable:
                sum(t.sum() for t in trainable).backward()
        if not graphs:
            raise UsageError(
                "autoshard.explain: Dynamo compiled no graph: the model's forward ran no tensor operation; pass a model (or factory) "
                "whose forward computes with its parameters and example inputs it accepts."
            )
        # Built while the fake group lives: collectives are priced by their group's ranks.
        return [Report(stages, options["profile"], title=f"graph {i} of {len(graphs)}, world size {world_size}", rank=0)
                for i, stages in enumerate(graphs)]
    finally:
        dist.destroy_process_group()
        torch.compiler.reset()  # the compiled code refers to the fake group


# -- command line ------------------------------------------------------------------------------


def load_factory(caller: str, spec: str) -> Callable[[], nn.Module]:
    """``path/to/file.py:name`` or ``package.module:name`` -> the callable ``name``; errors
    start with ``caller`` (the command: ``"autoshard explain"``)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UsageError(f"{caller}: expected FILE.py:FACTORY or MODULE:FACTORY, got {spec!r}; "
                         "e.g. examples/train_gpt.py:build_model")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise FileNotFoundError(f"no such file {where!r}")
            module_name = f"_autoshard_explain_{path.stem}"
            spec_ = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec_)
            sys.modules[module_name] = module  # dataclasses defined in the file look their module up
            spec_.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        factory = getattr(module, name)
    except Exception as e:  # anything the file raises on import is the file's problem
        raise UsageError(f"{caller}: cannot load {name} from {where}: {type(e).__name__}: {e}; "
                         "fix the path, the name or the file") from None
    if not callable(factory):
        raise UsageError(f"{caller}: cannot load {name} from {where}: {type(factory).__name__} is not callable; "
                         "name a function that returns the model")
    return factory


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is sizes joined by 'x', like 1x64; got {text!r}") from None
    if any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"negative size in {text!r}; sizes are >= 0, like 1x64")
    return shape


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that describe the model's inputs (:func:`input_maker` reads them)."""
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank, for models with cfg.block_size and cfg.vocab_size "
        "(default 1)")
    parser.add_argument("--seq", type=int, help="sequence length for such models (default: cfg.block_size)")
    parser.add_argument("--input-shape", type=_shape, action="append", metavar="SHAPE",
                        help="shape of one input, like 4x16 (repeat for several inputs); required for models without "
                            "cfg.block_size/vocab_size")
    parser.add_argument("--input-dtype", default="float32", help="dtype of the --input-shape inputs (default float32; e.g. long, bfloat16)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``autoshard explain`` flags."""
    parser.description = (
        "Compile one training step of FACTORY's model at --world-size ranks in this process (fake process group, "
        "fake tensors: no memory for weights), print the summary and write the report files."
    )
    parser.add_argument("factory", metavar="FILE.py:FACTORY", help="a function returning the model (nn.Module), e.g. "
        "examples/train_gpt.py:build_model; also MODULE:FACTORY")
    parser.add_argument("--world-size", type=int, default=8, help="ranks of the simulated world (default 8)")
    parser.add_argument("--profile", default="h100", help="device profile: h100, a100, cpu or a .json from `autoshard calibrate` (default "
        "h100)")
    add_input_arguments(parser)
    parser.add_argument("--schedule", choices=SCHEDULES, default="autoshard", help="backend option schedule (default autoshard)")
    parser.add_argument("--bucket-mb", type=float, help="backend option bucket_mb: cap on a bucket's size in MiB")
    parser.add_argument("--max-inflight-mb", type=float, help="backend option max_inflight_mb: cap on gathered parameters alive at once in "
        "MiB")
    parser.add_argument("--no-reshard-after-forward", action="store_true", help="backend option reshard_after_forward=False: keep gathered "
        "parameters for backward")
    parser.add_argument("--html", metavar="PATH", help="write the report page (self-contained HTML) here")
    parser.add_argument("--trace", metavar="PATH", help="write the simulated timeline as a Chrome trace (Perfetto, chrome://tracing) here")
    parser.add_argument("--dump-dir", metavar="DIR", help="backend option debug_dir: every stage as Python plus report.html, trace.json, "
        "summary.txt under DIR/rank0/graph<i>/")
    parser.add_argument("--passes", action="store_true", help="also print what each pass changed")


def input_maker(caller: str, args: argparse.Namespace) -> Callable[[nn.Module], list[torch.Tensor]]:
    """The model's example inputs as the :func:`add_input_arguments` flags describe them;
    errors start with ``caller`` (the command)."""
    def make(model: nn.Module) -> list[torch.Tensor]:
        if args.input_shape:
            dtype = getattr(torch, args.input_dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise UsageError(f"{caller}: --input-dtype: unknown dtype {args.input_dtype!r}; "
                                 "give a torch dtype's name, e.g. float32, long or bfloat16")
            return [torch.zeros(shape, dtype=dtype) for shape in args.input_shape]
        cfg = getattr(model, "cfg", None)
        if not (hasattr(cfg, "block_size") and hasattr(cfg, "vocab_size")):
            raise UsageError(f"{caller}: {type(model).__name__} has no cfg.block_size and cfg.vocab_size; "
                             "give its inputs with --input-shape")
        tokens = torch.zeros(args.batch, args.seq or cfg.block_size, dtype=torch.long)
        return [tokens, tokens]  # (idx, targets)

    return make


def _numbered(path: str, i: int, n: int) -> str:
    if n == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.graph{i}{p.suffix}"))


def run(args: argparse.Namespace) -> int:
    """``autoshard explain``: print each graph's summary, write the requested files; a bad
    factory or input exits with a one-line error."""
    options: dict[str, Any] = {"schedule": args.schedule}
    for key in ("bucket_mb", "max_inflight_mb"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.no_reshard_after_forward:
        options["reshard_after_forward"] = False
    if args.dump_dir:
        options["debug_dir"] = args.dump_dir
    try:
        factory = load_factory("autoshard explain", args.factory)
        reports = _explain(factory, input_maker("autoshard explain", args), args.world_size, args.profile, options)
    except ValueError as e:  # UsageError, OverBudgetError, ...: reported as one line, exit status 1
        message = str(e) if str(e).startswith("autoshard") else f"autoshard explain: {e}"  # ours name their API
        sys.exit(message.replace("\n", " "))
    for i, report in enumerate(reports):
        print(report.summary())
        if args.passes:
            print("\n".join(p.text() for p in report.passes))
        if args.html:
            report.save_html(_numbered(args.html, i, len(reports)))
            print(f"wrote {_numbered(args.html, i, len(reports))}")
        if args.trace:
            report.save_chrome_trace(_numbered(args.trace, i, len(reports)))
            print(f"wrote {_numbered(args.trace, i, len(reports))}")
        print()
    if args.dump_dir:
        print(f"wrote stages and reports under {args.dump_dir}/rank0/")
    return 0
