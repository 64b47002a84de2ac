"""Backend registration and option validation."""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from autoshard.compiler.options import Options, parse_options


def test_registered_as_a_dynamo_entry_point():
    assert "autoshard" in [ep.name for ep in entry_points(group="torch_dynamo_backends")]


def test_backend_works_without_importing_autoshard():
    code = (
        "import sys, torch\n"
        "m = torch.nn.Linear(4, 2)\n"
        "out = torch.compile(m, backend='autoshard', options={'compiler': 'aot_eager'})(torch.ones(3, 4))\n"
        "assert out.shape == (3, 2) and 'autoshard' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_without_debug_dir_the_environment_variable_names_the_folder(tmp_path, monkeypatch):
    """debug_dir's default is AUTOSHARD_DEBUG_DIR as it is when the model is compiled (set
    after autoshard was imported): the stages and the report land there, the report on the
    default profile off CUDA ("cpu"). Set but empty, it writes nothing."""
    monkeypatch.setenv("AUTOSHARD_DEBUG_DIR", str(tmp_path / "from_env"))
    torch._dynamo.reset()
    model = torch.compile(torch.nn.Linear(4, 2), backend="autoshard", options={"compiler": "aot_eager"})
    model(torch.ones(1, 4)).sum().backward()
    (folder,) = (tmp_path / "from_env" / "rank0").iterdir()
    assert {"forward.py", "backward.py", "summary.txt"} <= {p.name for p in folder.iterdir()}
    assert "profile cpu" in (folder / "summary.txt").read_text()

    monkeypatch.setenv("AUTOSHARD_DEBUG_DIR", "")
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    model = torch.compile(torch.nn.Linear(4, 2), backend="autoshard", options={"compiler": "aot_eager"})
    model(torch.ones(1, 4)).sum().backward()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from_env"]


def _positive(name: str, unit: str) -> list:
    # NaN and infinity too: NaN <= 0 is False, and either would fail the compile later, in int().
    return [({name: bad}, rf"^autoshard option '{name}' must be a positive number of {unit}, got {re.escape(repr(bad))}\.$")
            for bad in (0, -1.5, True, "64", float("nan"), float("inf"), float("-inf"))]


# Every option's bad values, each with the message that names it (test_every_option_has_bad_values checks all are here).
BAD_OPTIONS = [
    ({"bucket": 4}, r"autoshard backend: unknown option\(s\) \['bucket'\]; valid options are \['compiler'"),
    ({"compiler": "tvm"}, r"'compiler' must be one of \('inductor', 'aot_eager', 'eager'\), got 'tvm'"),
    ({"compiler": None}, r"'compiler' must be one of .*, got None"),
    *[({"reshard_after_forward": bad}, rf"^autoshard option 'reshard_after_forward' must be True, False or None, "
                                       rf"got {re.escape(repr(bad))}\.$") for bad in ("yes", 1, 0, 1.0)],
    *[({"debug_dir": bad}, rf"^autoshard option 'debug_dir' must be a path string or os.PathLike, got {re.escape(repr(bad))}\.$")
      for bad in (3, b"d")],
    ({"schedule": "fsdp"}, r"^autoshard option 'schedule' must be one of \('autoshard', 'none', 'fsdp2', 'inductor'\), got 'fsdp'\.$"),
    ({"schedule": None}, r"^autoshard option 'schedule' must be one of .*, got None\.$"),
    *_positive("bucket_mb", "MiB"),
    *_positive("max_inflight_mb", "MiB"),
    *_positive("memory_budget_gb", "GiB"),
    *[({"optimizer_states": bad}, rf"^autoshard option 'optimizer_states' must be a whole number >= 0 \(2 for Adam/AdamW\), "
                                  rf"got {re.escape(repr(bad))}\.$") for bad in (-1, 1.5, True, "2")],
    *[({"all_reduce_blocks": bad}, rf"^autoshard option 'all_reduce_blocks' must be a whole number >= 1 \(1: one all-reduce per "
                                   rf"block\), got {re.escape(repr(bad))}\.$") for bad in (0, -2, 2.0, True, "2", None)],
    *[({"telemetry": bad}, rf"^autoshard option 'telemetry' must be True or False, got {re.escape(repr(bad))}\.$")
      for bad in (1, "yes", None)],
    ({"profile": "tpu"},
     r"^autoshard option 'profile': unknown device profile 'tpu'; use one of \['a100', 'cpu', 'h100', 'h100_grand_teton'\]"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        parse_options(options)


def test_every_option_has_bad_values():
    tested = {name for case in BAD_OPTIONS for name in (case.values[0] if hasattr(case, "values") else case[0])}
    assert tested >= {f.name for f in fields(Options)}


def test_an_unreadable_profile_file_is_named(tmp_path):
    broken = tmp_path / "mine.json"
    broken.write_text("{not json")
    for path in (broken, tmp_path / "missing.json"):
        with pytest.raises(ValueError, match=rf"^autoshard option 'profile': cannot read device profile '{re.escape(str(path))}': "
                                             rf".*; write one with `autoshard calibrate --out {re.escape(str(path))}`\.$"):
            parse_options({"profile": str(path)})


def test_good_values_pass():
    """The boundaries of the checks above: the smallest good values are accepted as given."""
    opts = parse_options({"bucket_mb": 0.5, "max_inflight_mb": 1, "memory_budget_gb": 1e-3, "optimizer_states": 0,
                          "all_reduce_blocks": 1, "reshard_after_forward": False, "schedule": "none", "profile": "a100",
                          "debug_dir": "d"})
    assert (opts.bucket_mb, opts.max_inflight_mb, opts.memory_budget_gb, opts.optimizer_states) == (0.5, 1, 1e-3, 0)
    assert opts.all_reduce_blocks == 1 and parse_options({"all_reduce_blocks": 3}).all_reduce_blocks == 3
    assert (opts.reshard_after_forward, opts.schedule, opts.profile, opts.debug_dir) == (False, "none", "a100", "d")
    assert parse_options({"reshard_after_forward": True}).reshard_after_forward is True
    assert parse_options({"debug_dir": Path("d") / "e"}).debug_dir == str(Path("d") / "e")  # os.PathLike, kept as a string


def test_bad_options_fail_the_compile():
    torch._dynamo.reset()
    model = torch.compile(torch.nn.Linear(4, 2), backend="autoshard", options={"compilr": "eager"})
    with pytest.raises(Exception, match="autoshard backend: unknown option"):
        model(torch.ones(1, 4))


def test_debug_dir_holds_every_stage_as_python(tmp_path):
    torch._dynamo.reset()
    model = torch.compile(torch.nn.Linear(4, 2), backend="autoshard", options={"compiler": "aot_eager", "debug_dir": str(tmp_path)})
    model(torch.ones(1, 4)).sum().backward()
    (folder,) = (tmp_path / "rank0").iterdir()
    stages = {p.stem for p in folder.glob("*.py")}
    assert stages == {"captured", "joint", "lowered", "forward_bucketed", "backward_bucketed", "forward", "backward"}
    for path in folder.glob("*.py"):
        compile(path.read_text(), str(path), "exec")  # parses as Python
    assert {"report.html", "trace.json", "summary.txt"} <= {p.name for p in folder.iterdir()}  # and the report


@pytest.mark.parametrize("logged", [False, True])
def test_graphs_are_printed_as_text_only_for_a_log_that_shows_them(logged):
    """AOT autograd prints its joint, forward and backward graphs as text for its logs; under
    autoshard's backend only when such a log is on (TORCH_LOGS=aot_graphs here)."""
    from unittest import mock

    torch._dynamo.reset()
    printed = []
    original = torch.fx.GraphModule.print_readable

    def spy(self, *args, **kwargs):
        printed.append(self)
        return original(self, *args, **kwargs)

    model = torch.compile(torch.nn.Linear(4, 2), backend="autoshard", options={"compiler": "aot_eager"})
    try:
        torch._logging.set_logs(aot_graphs=logged)
        # No structured trace either: pytest's capture handlers would read one.
        with mock.patch.object(torch.fx.GraphModule, "print_readable", spy), \
                mock.patch.object(torch._logging._internal.trace_log, "handlers", []):
            model(torch.ones(1, 4)).sum().backward()
    finally:
        torch._logging.set_logs()
        torch._dynamo.reset()
    if logged:
        assert len(printed) >= 2  # the forward and backward graphs, as without autoshard
    else:
        assert not printed
