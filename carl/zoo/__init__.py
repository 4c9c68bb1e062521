"""Trained policies that ship with carl: ``policy=zoo:<name>`` wherever a bundle path is accepted.

Each ``carl/zoo/<name>/`` is a bundle written by ``carl-export`` (:mod:`carl.bundle`: weights, TorchScript, ONNX,
``spec.json`` with the files' sha256) plus ``card.md``: the command that trained it, seed, commit, samples, wall
time, CPU and its scores. Loading one reads safetensors and JSON only, like any bundle (docs/security.md).
"""
from __future__ import annotations

from pathlib import Path

ZOO_DIR = Path(__file__).resolve().parent
PREFIX = "zoo:"


class ZooError(ValueError):
    """``zoo:<name>`` names no shipped policy; the message lists those that ship."""


def names() -> list[str]:
    """The shipped policies (folders holding a ``spec.json``)."""
    return sorted(p.parent.name for p in ZOO_DIR.glob("*/spec.json"))


def resolve(policy: str) -> str:
    """``zoo:<name>`` -> the bundle folder's path; any other argument unchanged."""
    if not policy.startswith(PREFIX):
        return policy
    name = policy[len(PREFIX):]
    if name not in names():
        raise ZooError(f"policy={policy}: no such policy in the zoo ({ZOO_DIR}); shipped: "
                       f"{', '.join(PREFIX + n for n in names()) or 'none'}")
    return str(ZOO_DIR / name)
