"""Which Triton kernel variants get compiled while a block of code runs.

A variant compiled in the middle of serving stalls its step for one to two seconds, so
the engine compiles everything a step can need at start-up (engine/warmup.py, the decode
graphs). This watch is how benchmarks and tests check that promise: it sees every compile
(Triton's JIT cache hook fires before each one) and records the kernel and the argument
specialisation that made it new.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import triton


@dataclass(frozen=True)
class Compile:
    at_s: float  # perf_counter when the compile began
    kernel: str  # the variant as Triton describes it: name[options](arguments: specialisation)


def _hook_home():
    """The object that holds Triton's JIT cache hook: `triton.knobs.runtime` (Triton 3.4
    and later) or `JITFunction` itself (earlier 3.x)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
        return knobs.runtime, "jit_cache_hook"
    from triton.runtime.jit import JITFunction

    return JITFunction, "cache_hook"


@dataclass
class CompileWatch:
    """`with CompileWatch() as w: ...` then `w.compiles`. Chains to a hook installed before
    it and restores that hook on exit; watches may nest."""

    compiles: list[Compile] = field(default_factory=list)

    def __enter__(self) -> "CompileWatch":
        home, name = _hook_home()
        self._home, self._name = home, name
        self._previous = getattr(home, name)
        previous = self._previous

        def hook(*args, **kwargs):
            self.compiles.append(Compile(time.perf_counter(), str(kwargs.get("repr", kwargs.get("key", "?")))))
            # A true result would tell Triton to skip the compile: only the hook before ours decides that.
            return previous(*args, **kwargs) if previous is not None else None

        setattr(home, name, hook)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self._home, self._name, self._previous)
