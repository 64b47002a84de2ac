"""Backend registration and option validation."""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

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


def test_defaults():
    assert parse_options(None) == Options(compiler="inductor", reshard_after_forward=None, debug_dir=None)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"bucket": 4}, r"autoshard backend: unknown option\(s\) \['bucket'\]; valid options are \['compiler'"),
        ({"compiler": "tvm"}, r"'compiler' must be one of \('inductor', 'aot_eager', 'eager'\), got 'tvm'"),
        ({"reshard_after_forward": "yes"}, "'reshard_after_forward' must be True, False or None"),
        ({"debug_dir": 3}, "'debug_dir' must be a path string"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        parse_options(options)


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
