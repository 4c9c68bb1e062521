"""carl: PPO training for driving planners with CaRL's recipe.

``carl.load_policy(path)`` (a policy bundle directory or a training checkpoint) returns ``(policy, spec)``; see
:mod:`carl.bundle`. It is imported lazily so that ``import carl`` stays cheap.
"""
from __future__ import annotations

from typing import Any

__all__ = ["load_policy"]


def __getattr__(name: str) -> Any:
    if name == "load_policy":
        from carl.bundle import load_policy

        return load_policy
    raise AttributeError(f"module 'carl' has no attribute {name!r}")
