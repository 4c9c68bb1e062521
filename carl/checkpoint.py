"""Checkpoints: atomic writes, RNG capture and loading with clear errors.

A checkpoint is a ``torch.save`` dict with ``format_version``, ``signature`` (the model's observation shapes and
layer plan, and the names of its inputs and actions where known), ``model``, ``optimizer``, ``update``, ``global_step``, ``rng``, ``env`` (the env's ``state_dict()``),
``config`` and free-form ``extra``. Files are written to ``<name>.tmp``, fsynced and moved over the target with
``os.replace``, so a crash (even ``kill -9``) leaves either the previous or the new file, never a torn one.
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or belongs to another model; the message names the file."""


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to ``path`` atomically (tmp file + fsync + os.replace + directory fsync)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return path


def capture_rng() -> dict[str, Any]:
    """RNG states of python, numpy, torch (CPU) and every CUDA device."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def make_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    update: int,
    global_step: int,
    signature: dict,
    config: dict,
    env_state: dict | None = None,
    extra: dict | None = None,
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "signature": signature,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "update": update,
        "global_step": global_step,
        "rng": capture_rng(),
        "env": env_state or {},
        "config": config,
        "extra": extra or {},
    }


def _compatible(expected: dict, found: dict) -> list[str]:
    """Differences between two model signatures that make the weights unloadable (num_params is informative)."""
    diffs = []
    for key in ("obs_shapes", "conv"):
        if expected.get(key) != found.get(key):
            diffs.append(f"{key}: checkpoint has {found.get(key)}, this model has {expected.get(key)}")
    # inputs of the same shapes that mean other things (a checkpoint without names predates them: not compared)
    if "layout" in expected and "layout" in found and expected["layout"] != found["layout"]:
        diffs.append(f"layout: checkpoint has {found['layout']}, this model has {expected['layout']}")
    return diffs


def load_checkpoint(path: str | Path, signature: dict | None = None, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and check a checkpoint; raise :class:`CheckpointError` naming ``path`` on any problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise CheckpointError(f"checkpoint {path} is corrupt or not a checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(ckpt, dict) or "format_version" not in ckpt:
        raise CheckpointError(f"checkpoint {path} is not a carl checkpoint (no format_version)")
    if ckpt["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {ckpt['format_version']}, this code reads version {FORMAT_VERSION}"
        )
    if signature is not None:
        diffs = _compatible(signature, ckpt.get("signature", {}))
        if diffs:
            raise CheckpointError(f"checkpoint {path} belongs to another model: " + "; ".join(diffs))
    return ckpt


def restore(ckpt: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, rng: bool = True) -> None:
    """Load weights (strict), optimiser state and RNG states from a loaded checkpoint."""
    model.load_state_dict(ckpt["model"])
    if optimizer is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if rng:
        restore_rng(ckpt["rng"])
