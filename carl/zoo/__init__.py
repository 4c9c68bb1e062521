"""Trained policies that ship with carl: ``policy=zoo:<name>`` wherever a bundle path is accepted.

Each ``carl/zoo/<name>/`` is a bundle written by ``carl-export`` (:mod:`carl.bundle`: weights, TorchScript, ONNX,
``spec.json`` with the files' sha256) plus ``card.md``: the command that trained it, seed, commit, samples, wall
time, CPU and its scores. Loading one reads safetensors and JSON only, like any bundle (docs/security.md).
``aliases.json`` names a recipe's best policy whatever its observation path (``zoo:towns`` -> ``towns_vector``).
"""
from __future__ import annotations

import json
from pathlib import Path

ZOO_DIR = Path(__file__).resolve().parent
PREFIX = "zoo:"


class ZooError(ValueError):
    """``zoo:<name>`` names no shipped policy; the message lists those that ship."""


def names() -> list[str]:
    """The shipped policies (folders holding a ``spec.json``)."""
    return sorted(p.parent.name for p in ZOO_DIR.glob("*/spec.json"))


def aliases() -> dict[str, str]:
    """Other names of shipped policies (``aliases.json``: alias -> folder), e.g. a recipe's best policy."""
    path = ZOO_DIR / "aliases.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def resolve(policy: str) -> str:
    """``zoo:<name>`` (a folder or an alias) -> the bundle folder's path; any other argument unchanged."""
    if not policy.startswith(PREFIX):
        return policy
    name = policy[len(PREFIX):]
    name = aliases().get(name, name)
    if name not in names():
        known = [PREFIX + n for n in names()] + [f"{PREFIX}{a} (= {t})" for a, t in aliases().items()]
        raise ZooError(f"policy={policy}: no such policy in the zoo ({ZOO_DIR}); shipped: "
                       f"{', '.join(known) or 'none'}")
    return str(ZOO_DIR / name)
