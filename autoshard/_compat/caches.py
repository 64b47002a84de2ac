"""PyTorch's compile caches (FX graph cache, AOT autograd cache), as the backend uses them.

The AOT autograd cache keys a compile on the Dynamo graph and on Inductor's and functorch's
configs; ``functorch.config.joint_custom_pass`` (where autoshard's joint passes run) is left
out of that key, as any callable is. A custom post-grad pass that has a ``uuid()`` is in it
(Inductor's ``FxGraphHashDetails``), so the backend puts what changes its result there.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["caches_on", "keyed_by", "cache_counts"]


def caches_on() -> bool:
    """Whether a compile with Inductor may be served by the local AOT autograd cache (which
    needs the FX graph cache too)."""
    return bool(functorch_config.enable_autograd_cache and inductor_config.fx_graph_cache)


class _KeyPass(CustomGraphPass):
    """Changes no graph; its ``uuid()`` (autoshard's part of the cache key) joins the key of
    every compile made inside :func:`keyed_by`. Runs the user's own pass, if one was set."""

    def __init__(self, key: str, user: Any) -> None:
        self.key, self.user = key, user

    def __call__(self, graph: Any) -> None:
        if self.user is not None:
            self.user(graph)

    def uuid(self) -> Any:
        if self.user is None:
            return ("autoshard", self.key)
        # A user pass without a uuid() makes Inductor skip its caches, as it would without us.
        user = self.user.uuid() if isinstance(self.user, CustomGraphPass) else None
        return None if user is None else ("autoshard", self.key, user)


@contextlib.contextmanager
def keyed_by(key: str) -> Iterator[None]:
    """Inside, every compile's AOT autograd and FX graph cache key includes ``key``."""
    with inductor_config.patch(post_grad_custom_post_pass=_KeyPass(key, inductor_config.post_grad_custom_post_pass)):
        yield


def cache_counts() -> dict[str, int]:
    """This process's cache hits and misses so far: AOT autograd's and the FX graph cache's."""
    aot, inductor = counters["aot_autograd"], counters["inductor"]
    return {
        "autograd_hit": aot["autograd_cache_hit"], "autograd_miss": aot["autograd_cache_miss"],
        "autograd_bypass": aot["autograd_cache_bypass"],
        "fxgraph_hit": inductor["fxgraph_cache_hit"], "fxgraph_miss": inductor["fxgraph_cache_miss"],
    }
