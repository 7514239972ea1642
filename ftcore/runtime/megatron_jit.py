"""Without CUDA, megatron-core's fused functions are left uncompiled: ~3.3 s less CPU per process.

As it is imported, megatron-core wraps a few dozen fused functions in `torch.compile`
(`megatron/core/jit.py`: `jit_fuser`), and the first wrap imports torch._dynamo and
torch._inductor: 6.0 s of CPU to import megatron-core here, 2.7 s without (measured on the 2-core
VM). On a machine without CUDA those functions are never compiled for anything ftcore runs (its
local layer spec has its own kernels), so the import is pure start-up cost, paid by every rank of
every CPU run and every test process. megatron offers `disable_jit_fuser()`, but it only helps if
it runs after `megatron.core.jit` executes and before the fused modules apply the decorator, which
happens inside megatron's own package import. `install()` adds an import hook for that one module
that calls it; on a machine with CUDA it changes nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

MODULE = "megatron.core.jit"


class _AfterJitImport(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        import torch  # already imported: megatron.core.jit imports it

        if not torch.cuda.is_available():
            module.disable_jit_fuser()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # one use: the real finders locate the module
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterJitImport(spec.loader)
        return spec


def install() -> None:
    """Before megatron-core is first imported (entry points, test workers); idempotent."""
    if MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
