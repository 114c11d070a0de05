"""Test helper: which Triton kernel variants a piece of host code would compile, on CPU.

Every `@triton.jit` kernel of `agent_infer.kernels.triton` is replaced by a stand-in that
launches nothing and records the variant the launch would need: the kernel's name,
Triton's own specialisation of its arguments (each tensor's dtype and 16-byte alignment,
each int's "equal to 1 / divisible by 16" class unless the kernel opts out, every
constexpr value) and the launch options. Two launches with the same record reuse one
compiled kernel; a record not seen before is a compilation.

`dispatch_to_triton` makes `kernels.ops` take the Triton path for CPU tensors too, so
model code runs its GPU launches on CPU (their outputs are left uninitialised, which
is fine for counting variants and nothing else).
"""

from __future__ import annotations

import importlib
import pkgutil
from contextlib import contextmanager
from typing import Iterator

import pytest


def _hashable(x):
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    return x if isinstance(x, (int, float, str, bool, type(None))) else repr(x)


class VariantRecorder:
    def __init__(self):
        self.variants: set[tuple] = set()

    def record(self, fn, args, kwargs) -> None:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(fn.signature, fn.params, BaseBackend)
        _, specialization, options = binder(*args, **kwargs)
        self.variants.add((fn.__name__, _hashable(specialization), _hashable(options)))

    @contextmanager
    def active(self) -> Iterator["VariantRecorder"]:
        """Patch every kernel (module attributes of agent_infer.kernels.triton.*)."""
        from triton.runtime.jit import JITFunction

        import agent_infer.kernels.triton as pkg

        recorder = self

        class Stub:
            def __init__(self, fn):
                self.fn = fn

            def __getitem__(self, grid):
                return lambda *args, **kwargs: recorder.record(self.fn, args, kwargs)

        # Every module imported before any is patched: one importing a sibling's jit helper
        # (router.py's gemv.row_dot) must bind the real function, not a stub it would keep.
        modules = [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]
        with pytest.MonkeyPatch.context() as mp:
            for module in modules:
                for name, obj in list(vars(module).items()):
                    if isinstance(obj, JITFunction):
                        mp.setattr(module, name, Stub(obj))
            yield self


@contextmanager
def dispatch_to_triton() -> Iterator[None]:
    from agent_infer.kernels import ops

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "_use_triton", lambda x: True)
        yield
