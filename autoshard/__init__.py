"""autoshard: fully sharded data parallel training (FSDP / ZeRO-3) as a torch.compile backend.

    autoshard.shard(model)                             # parameters become per-rank shards
    model = torch.compile(model, backend="autoshard")  # the backend does the rest
"""
import sys

from autoshard.compiler import backend  # noqa: F401 - registers backend='autoshard' (also an entry point)
from autoshard.compiler.dump import register_report_writer
from autoshard.compiler.logs import register_timeline
from autoshard.cost.cluster import Cluster, NodeGroup
from autoshard.runtime import checkpoint, errors, ops
from autoshard.runtime.batch_shares import batch_sizes, set_batch_shares, split_batch
from autoshard.runtime.checkpoint import full_state_dict, load, save
from autoshard.runtime.compression import Compression
from autoshard.runtime.errors import (
    AutoshardError,
    CheckpointError,
    InflightCapError,
    OverBudgetError,
    PlanMismatchError,
    RankFailedError,
    UsageError,
)
from autoshard.runtime.layout import ShardLayout
from autoshard.runtime.materialize import materialize
from autoshard.runtime.mixed_precision import MixedPrecision
from autoshard.runtime.shard import is_sharded, shard
from autoshard.runtime.state_shares import full_tensor
from autoshard.runtime.telemetry import Telemetry
from autoshard.runtime.tp_plans import gpt_tp_plan, transformers_tp_plan
from autoshard.tools import launch
from autoshard.tools.explain import explain, explain_graphs
from autoshard.tools.plan.plan import Plan, plan
from autoshard.tools.report.report import Report, timeline, write_report

# The public API: what README and docs/ document (tests/test_public_api.py). The backend, the
# launcher and the annotation ops stay reachable (autoshard.launch.run_ranks, autoshard.ops) for
# the tests and benchmarks, but are not part of it.
__all__ = [
    "AutoshardError", "CheckpointError", "Cluster", "Compression", "InflightCapError", "MixedPrecision", "NodeGroup",
    "OverBudgetError", "Plan", "PlanMismatchError", "RankFailedError", "Report", "ShardLayout", "Telemetry", "UsageError",
    "batch_sizes", "explain", "explain_graphs", "full_state_dict", "full_tensor", "gpt_tp_plan", "is_sharded", "load", "materialize",
    "plan", "save", "set_batch_shares", "shard", "split_batch", "transformers_tp_plan",
]

# Module paths users import (``autoshard.launch.run_ranks``, ``import autoshard.checkpoint``, ``autoshard.errors``)
# stay stable whichever subpackage holds the module.
for _name, _module in {"checkpoint": checkpoint, "errors": errors, "launch": launch, "ops": ops}.items():
    sys.modules[f"{__name__}.{_name}"] = _module

register_report_writer(write_report)  # the backend's debug_dir reports: report.html, trace.json, summary.txt
register_timeline(timeline)  # TORCH_TRACE's autoshard_timeline artifact: the same simulated step
