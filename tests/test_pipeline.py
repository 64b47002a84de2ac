"""The declared pipeline: its order check, its stage names and how the backend runs it."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import fx

from autoshard._compat import c10d
from autoshard.compiler import pipeline
from autoshard.compiler.options import Options
from autoshard.compiler.pipeline import gloo_memory
from autoshard.cost.cost_model import get_profile
from autoshard.passes.graph_utils import collective_kind, is_exchange, wait_of
from autoshard.passes.step_model import Storages
from autoshard.tools.report.report import STAGES

from fake_pg import sharded_step
from pass_graphs import Stack


def test_the_stages_keep_their_names_and_order():
    assert STAGES == ("captured", "joint", "lowered", "forward_bucketed", "forward", "backward_bucketed", "backward")


def test_a_misordered_list_is_a_clear_error():
    steps = list(pipeline.PARTITIONED)
    bucket = next(s for s in steps if getattr(s, "name", "") == "bucket_collectives")
    steps.remove(bucket)
    steps.append(bucket)  # now after schedule_overlap, which needs its buckets
    with pytest.raises(ValueError, match=r"'schedule_overlap' requires \['buckets'\].*schedule 'autoshard'"):
        pipeline.check_order(steps)
    lower = next(s for s in pipeline.PARTITIONED if getattr(s, "name", "") == "lower_annotations")
    with pytest.raises(ValueError, match="lowered collectives"):
        pipeline.check_order([s for s in pipeline.PARTITIONED if s is not lower])


def test_a_pass_for_one_schedule_is_checked_under_that_schedule_only():
    needs = pipeline.Pass("needs", lambda gm, ctx: None, None, frozenset({"x"}), schedules=("inductor",))
    gives = pipeline.Pass("gives", lambda gm, ctx: None, None, provides=frozenset({"x"}), schedules=("inductor",))
    pipeline.check_order([gives, needs])
    with pytest.raises(ValueError, match="'needs' requires \\['x'\\].*'inductor'"):
        pipeline.check_order([needs, gives])


def test_run_applies_only_the_schedules_steps_and_writes_their_stages():
    ran, written = [], []
    steps = [
        pipeline.Pass("a", lambda gm, ctx: ran.append("a"), None),
        pipeline.Pass("b", lambda gm, ctx: ran.append("b"), None, schedules=("fsdp2",)),
        pipeline.Stage("{side}_mid", schedules=("fsdp2",)),
        pipeline.Stage("{side}"),
    ]
    gm = fx.GraphModule({}, fx.Graph())
    for schedule in ("none", "fsdp2"):
        pipeline.run(steps, gm, pipeline.Context(Options(schedule=schedule), "backward"), lambda s, g: written.append(s))
    assert ran == ["a", "a", "b"] and written == ["backward", "backward_mid", "backward"]
    assert [pipeline.keeps_order(s) for s in ("autoshard", "none", "fsdp2", "inductor")] == [True, False, True, True]


def test_the_report_describes_each_step_from_the_declaration():
    assert pipeline.what_happened("joint", "lowered") == (
        "shared parameters merged, then annotations replaced by collectives"
    )
    expected = ("partition, then collectives nothing reads dropped, repeated waits merged, then bucket: per-parameter "
                "collectives merged into flat ones")
    assert pipeline.what_happened("lowered", "backward_bucketed") == expected
    assert pipeline.what_happened("forward_bucketed", "forward") == (
        "schedule: prefetch and reorder within the memory budget, then over gloo, gathers write into buffers, reduce-scatters "
        "run as all-to-alls, and the graph frees their buffers after their last use"
    )
    assert pipeline.what_happened("captured", "forward").startswith("AOT autograd: traced to ATen (inference: no backward), then lower")


def _what_the_graph_does(gm: fx.GraphModule) -> pipeline.CollectiveMemory:
    """Read from a graph after the gloo step what its collectives' buffers hold, in the memory
    model's terms: ``late_release``, the kinds with a buffer the graph allocated and does not
    free after the wait (gloo's thread frees it when it likes); ``output_at_wait``, the kinds
    whose result (for an all-to-all, the reduction over the ranks of what it received) is made
    after the wait; ``input_copied``, the kinds whose input has no storage of its own (it is
    part of the collective's buffer, or a placeholder the caller holds anyway)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    root = Storages(nodes).root
    freed = {root[n.args[0]]: order[n] for n in nodes if n.target is torch.ops.inductor.resize_storage_bytes_.default}
    found: dict[str, dict[str, bool]] = {"late": {}, "at_wait": {}, "copied": {}}

    def note(what: str, kind: str, holds: bool) -> None:  # a kind has the property when every collective of it has
        found[what][kind] = found[what].get(kind, True) and holds

    for c in nodes:
        kind = collective_kind(c)
        if kind not in ("all_gather", "reduce_scatter"):
            continue
        wait = wait_of(c)
        buffers = {root[a] for a in c.all_input_nodes} | {root[c]}
        allocated = [b for b in buffers if b.op != "placeholder"]
        note("late", kind, any(b not in freed or freed[b] < order[wait] for b in allocated))
        if is_exchange(c):  # the result: the reduction over ranks of the received copies, read through a view
            (stacked,) = [u for u in wait.users if u.target is not torch.ops.inductor.resize_storage_bytes_.default]
            result = [u for u in stacked.users if u.target is not torch.ops.inductor.resize_storage_bytes_.default]
        else:
            result = [root[c]]
        note("at_wait", kind, all(order[r] > order[wait] for r in result))
        source = root[c.args[0]]  # a shard (a placeholder: held anyway) or part of the buffer: no copy-in of its own
        note("copied", kind, source is root[c] or source.op == "placeholder")
    late, at_wait, copied = ({k for k, holds in found[w].items() if holds} for w in ("late", "at_wait", "copied"))
    return pipeline.CollectiveMemory(tuple(sorted(late)), tuple(sorted(at_wait)), tuple(sorted(copied)))


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_the_memory_model_follows_what_the_gloo_pass_does(compiler):
    """Runs the pipeline's gloo step on a scheduled forward and backward (its groups taken for
    gloo's) and reads the result back (:func:`_what_the_graph_does`). Graphs run op by op
    (aot_eager) are what ``gloo_memory`` tells the memory model, exactly: reduce-scatters become
    all-to-alls whose reduced result is made after the wait, gathers read their input from their
    buffer, and the graph frees every buffer it allocated. Inductor's graphs free nothing: the
    model must keep them alive late, and may assume no more than the graph does."""
    cpu = get_profile("cpu")
    model = gloo_memory(cpu.comm_release_late, cpu.comm_input_copied, compiler)
    gloo = next(s for s in pipeline.PARTITIONED if getattr(s, "name", "") == "gloo")
    with sharded_step(Stack, lambda: (torch.randn(2, 8), torch.randn(2, 6)), world_size=4, options={"profile": "cpu"}) as step, \
            mock.patch("autoshard.passes.gloo.group_backend", return_value="gloo"):
        done = []
        for side in ("forward", "backward"):
            gm = step.only(side)
            assert not gm.graph.find_nodes(op="call_function", target=c10d.all_to_all_single.default)  # a fake group: not yet
            gloo.run(gm, pipeline.Context(Options(compiler=compiler), side))
            done.append(_what_the_graph_does(gm))
    forward, backward = done
    assert forward.late_release == tuple(k for k in backward.late_release if k == "all_gather")  # gathers alike on both sides
    does = backward
    if compiler == "aot_eager":
        assert model == does == pipeline.CollectiveMemory((), ("reduce_scatter",), ("all_gather",))
    else:
        assert does.late_release == ("all_gather", "reduce_scatter")
        assert set(model.late_release) >= set(does.late_release)
        assert set(model.output_at_wait) <= set(does.output_at_wait) and set(model.input_copied) <= set(does.input_copied)
