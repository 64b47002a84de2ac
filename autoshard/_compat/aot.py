"""AOT autograd settings the backend changes for one compile."""
from __future__ import annotations

import contextlib

import torch._functorch.config as functorch_config


def backward_compiled_with_forward() -> contextlib.AbstractContextManager:
    """Inside, AOT autograd compiles a training graph's backward with its forward instead of at
    the first backward call, so what the backward's compile raises reaches the backend's caller
    (which may compile again). A release without the setting compiles it lazily, as before."""
    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return functorch_config.patch(force_non_lazy_backward_lowering=True)
