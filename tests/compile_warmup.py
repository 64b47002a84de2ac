"""Imported once by the launcher's fork server (tests/conftest.py appends it to
``autoshard.tools.launch.PRELOAD``): what every rank's first compile otherwise does again in
each launch, before any graph of its own. Measured on 2 busy cores: a rank's first Inductor
compile spent about 3.5 s importing Inductor's code generators, passes and backends and 2.2 s
checking which vector ISAs the C++ compiler builds (a test program and a subprocess per ISA);
a second compile in the same process spent neither. (Inductor's pattern registration, 0.8 s
more, is left to the ranks: it starts tqdm's monitor thread, and a fork server must not hold
threads.)

Imports and process-wide caches only: no graph is compiled here, no thread is started, and
what the ranks compute is unchanged (the same lazy initialisation, done before the fork).
"""
from __future__ import annotations

import importlib

import torch
import torch._dynamo

_MODULES = (
    "torch._inductor.compile_fx",
    "torch._inductor.codegen.cpp",
    "torch._inductor.codegen.cpp_wrapper_cpu",
    "torch._inductor.fx_passes.pre_grad",
    "torch._inductor.fx_passes.joint_graph",
    "torch._inductor.fx_passes.post_grad",
    "torch._functorch.compilers",
    "torch.utils.cpp_extension",
    "torch.distributed.tensor.experimental",
)


def _warm() -> None:
    for name in _MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # another torch release lays its modules out otherwise: the rank imports what it needs
            pass
    torch._dynamo.list_backends()  # imports every registered backend's module (aot_eager's, Inductor's)
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()  # functools.cache: the forked ranks inherit the answer


_warm()
