"""``torch.compile`` where it pays, with a clear error where it cannot run: the simulator's fixed-shape stages
(``env.options.vector.compile``) and the trainer's network (``parallel.compile``).

On a 2-core CPU a stage of a few dozen small ops over [B, N, F] tensors costs its op count (~3-20 µs each, the
dispatch and one pass over memory per op) more than its arithmetic; inductor fuses such a stage into a few C++
loops (docs/simulator.md, "Compiled stages"; docs/training.md, "Throughput"). A shape compiles on its first call
(seconds; torch caches the code on disk), then every call reuses it.
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import InductorError

from envs.config import ConfigError

F = TypeVar("F", bound=Callable)

# the compiler's own failures only: an error of the compiled code (a bad shape) surfaces as itself
FAILURES = (BackendCompilerFailed, InductorError)


def compiled(fn: F, key: str, dynamic: bool | None = False) -> F:
    """``fn`` compiled (``dynamic`` as torch.compile's: False = a graph per shape, None = one that generalises once a
    second shape comes); a platform that cannot compile it (no C++ compiler, an unsupported architecture) raises a
    :class:`ConfigError` naming ``key``, the option that asked for it, and the fix."""
    compiled_fn = torch.compile(fn, dynamic=dynamic)

    @functools.wraps(fn)
    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the stage's own signature
        try:
            return compiled_fn(*args, **kwargs)
        except FAILURES as e:
            reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{key}=true: torch.compile cannot compile {fn.__qualname__} on this platform "
                              f"({type(e).__name__}: {reason}); set {key}=false to run it uncompiled, or install "
                              "a C++ compiler that torch inductor supports (gcc or clang)") from e

    return call  # type: ignore[return-value]
