"""autoshard's graph passes: each a deterministic ``GraphModule -> GraphModule`` function.

Installed as ``autoshard.passes``. In pipeline order: merge_shared_parameters and
lower_annotations run on the joint forward+backward graph.
"""
from .lower import lower_annotations
from .merge_shared import merge_shared_parameters

__all__ = ["lower_annotations", "merge_shared_parameters"]
