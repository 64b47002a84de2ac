"""autoshard: fully sharded data parallel training (FSDP / ZeRO-3) as a torch.compile backend.

    autoshard.shard(model)                             # parameters become per-rank shards
    model = torch.compile(model, backend="autoshard")  # the backend does the rest
"""
from . import checkpoint, ops
from .backend import autoshard_backend
from .checkpoint import full_state_dict, load, save
from .explain import explain, explain_graphs
from .materialize import materialize, shards_in_place
from .mixed_precision import MixedPrecision
from .report import Report
from .shard import shard

__all__ = [
    "MixedPrecision", "Report", "autoshard_backend", "checkpoint", "explain", "explain_graphs", "full_state_dict", "load",
    "materialize", "ops", "save", "shard", "shards_in_place",
]
