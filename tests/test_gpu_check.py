"""bench/gpu_check.py's CPU path: the check prepared for a lent GPU runs here on the tiny shape
(aot_eager, fake process group at world size 8) and fills every row."""
from __future__ import annotations

import json
import math

import torch.distributed as dist

import gpu_check

ROWS = [("fp32", "unsharded"), ("fp32", "autoshard"), ("bf16", "unsharded"), ("bf16", "autoshard")]


def _positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_the_cpu_path_measures_every_row(tmp_path, capsys):
    out = tmp_path / "check.json"
    rows = gpu_check.main(["--device", "cpu", "--compiler", "aot_eager", "--steps", "3", "--json", str(out)])
    assert not dist.is_initialized()  # the fake group is torn down

    assert [(r["precision"], r["system"]) for r in rows] == ROWS
    assert gpu_check.problems(rows) == []
    for r in rows:
        assert r["graphs"] == 1
        assert all(_positive(r[k]) for k in ("step_ms", "step_vs_unsharded", "peak_mib")), r
        assert len(r["step_ms_all"]) == 3
        assert "kernels" not in r  # aot_eager generates no code
    by = {(r["precision"], r["system"]): r for r in rows}
    for precision in ("fp32", "bf16"):
        sharded, unsharded = by[precision, "autoshard"], by[precision, "unsharded"]
        assert unsharded["step_vs_unsharded"] == 1.0 and "predicted_peak_mib" not in unsharded
        assert sharded["step_vs_unsharded"] == sharded["step_ms"] / unsharded["step_ms"]
        assert _positive(sharded["predicted_peak_mib"])
        assert sharded["peak_vs_predicted"] == sharded["peak_mib"] / sharded["predicted_peak_mib"]
        assert 0.5 < sharded["peak_vs_predicted"] < 2  # measured and simulated memory agree roughly
    # bfloat16 gathers and activations reach the graph the simulator reads.
    assert by["bf16", "autoshard"]["predicted_peak_mib"] < by["fp32", "autoshard"]["predicted_peak_mib"]

    saved = json.loads(out.read_text())
    assert saved["finished"] and saved["config"]["world_size"] == 8 and saved["config"]["layers"] == 2
    assert [(r["precision"], r["system"]) for r in saved["rows"]] == ROWS
    assert saved["rows"][1]["peak_mib"] == rows[1]["peak_mib"]

    table = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("precision"))
    assert table[header].split() == list(gpu_check.TABLE)
    assert [tuple(line.split()[:2]) for line in table[header + 2:header + 6]] == ROWS
    assert table[header + 6] == "check: ok"


def test_generated_code_is_counted_by_kernel_kind_and_collective():
    # The shape of Inductor's CUDA wrapper code, which this machine cannot produce.
    code = """
triton_poi_fused_0 = async_compile.triton('triton_poi_fused_0', '''
@triton.jit
def triton_poi_fused_0(in_ptr0, out_ptr0, xnumel, XBLOCK: tl.constexpr): ...
''', device_str='cuda')
triton_red_fused_1 = async_compile.triton('triton_red_fused_1', '''...''', device_str='cuda')
async_compile.wait(globals())
        buf1 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf0, 8, '0')
        torch.ops._c10d_functional.wait_tensor.default(buf1)
        buf3 = torch.ops._c10d_functional.reduce_scatter_tensor.default(buf2, 'avg', 8, '0')
"""
    kinds, collectives = gpu_check.generated([code])
    assert kinds == {"triton": 2} and collectives == 2


def test_presets_fill_only_what_is_not_given():
    args = gpu_check.parse_args(["--device", "cpu", "--layers", "3", "--embd", "128"])
    assert (args.layers, args.embd, args.heads, args.seq, args.compiler) == (3, 128, 2, 32, "inductor")
