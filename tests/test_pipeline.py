"""The declared pipeline: its order check, its stage names and how the backend runs it."""
from __future__ import annotations

import pytest
from torch import fx

from autoshard.compiler import pipeline
from autoshard.compiler.options import Options
from autoshard.tools.report import STAGES


def test_the_stages_keep_their_names_and_order():
    assert STAGES == ("captured", "joint", "lowered", "forward_bucketed", "forward", "backward_bucketed", "backward")


def test_the_declared_lists_are_in_a_valid_order():
    pipeline.check_order(pipeline.JOINT)
    pipeline.check_order(pipeline.PARTITIONED)


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
    expected = "partition, then bucket: per-parameter collectives merged into flat ones"
    assert pipeline.what_happened("lowered", "backward_bucketed") == expected
    assert pipeline.what_happened("forward_bucketed", "forward") == (
        "schedule: prefetch and reorder within the memory budget, then over gloo, gathers write into buffers, reduce-scatters "
        "run as all-to-alls, and the graph frees their buffers after their last use"
    )
    assert pipeline.what_happened("captured", "forward").startswith("AOT autograd: traced to ATen (inference: no backward), then lower")


def test_the_memory_model_follows_what_the_gloo_pass_does():
    """Over gloo reduce-scatters become all-to-alls, which read their input until the wait;
    graphs run op by op make the result at the wait and free their buffers; Inductor's leave
    them to gloo's thread (late); other backends change nothing."""
    copied = ("reduce_scatter",)
    memory = pipeline.CollectiveMemory
    assert pipeline.gloo_memory((), copied, "aot_eager") == memory(
        late_release=(), output_at_wait=("reduce_scatter",), input_copied=("all_gather",))
    assert pipeline.gloo_memory((), copied, "inductor") == memory(late_release=("all_gather", "reduce_scatter"))
    assert pipeline.gloo_memory((), (), "aot_eager") == memory()
