"""Checkpoints: atomic writes, RNG capture, and loading that never runs code from the file.

A checkpoint is a ``torch.save`` dict with ``format_version``, ``signature`` (the model's observation shapes and
layer plan, and the names of its inputs and actions where known), ``model``, ``optimizer``, ``update``,
``global_step``, ``rng``, ``env`` (the env's ``state_dict()``), ``config`` and free-form ``extra``. Files are written to
``<name>.tmp``, fsynced and moved over the target with ``os.replace``, so a crash (even ``kill -9``) leaves either the
previous or the new file, never a torn one.

Safety: a checkpoint holds only tensors and plain data (dicts, lists, tuples, str, numbers, bools, None), checked
when it is written (:func:`plain_data`), and it is read with ``torch.load(weights_only=True)``, whose unpickler
builds nothing else: a file that asks for any other Python object (a ``__reduce__`` that calls ``os.system``, say)
is refused before anything from it runs. Format 1 (before 2026-11-25) kept numpy's RNG state as a numpy array;
the array type alone is allowed for those files, so they load as they are (docs/security.md).
"""
from __future__ import annotations

import os
import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 2  # 2: nothing but tensors and plain data (numpy's RNG state as a tensor)
READABLE_VERSIONS = (1, 2)
# format 1 stored np.random.get_state(), whose key array pickles through these (numpy 2's and numpy 1's names)
_reconstruct = (getattr(np, "_core", None) or np.core).multiarray._reconstruct
_NUMPY_ARRAY_GLOBALS = [(_reconstruct, "numpy._core.multiarray._reconstruct"),
                        (_reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype,
                        type(np.dtype(np.uint32))]
PLAIN_TYPES = (str, int, float, bool, type(None), bytes, torch.Size, torch.dtype, torch.device)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, unsafe or belongs to another model; the message names the file."""


def plain_data(obj: Any, where: str = "checkpoint") -> None:
    """Raise ``TypeError`` naming the key of the first value that is not a tensor or plain data (what a
    ``weights_only`` load could not read back)."""
    if isinstance(obj, torch.Tensor) or isinstance(obj, PLAIN_TYPES):
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; use str or int keys")
            plain_data(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            plain_data(value, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint holds only tensors "
                    "and plain data (dict, list, tuple, str, int, float, bool, None)")


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to ``path`` atomically (tmp file + fsync + os.replace + directory fsync)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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
    """RNG states of python, numpy, torch (CPU) and every CUDA device, as tensors and plain data."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the RNG states :func:`capture_rng` took (format 1's numpy tuple too)."""
    random.setstate(state["python"])
    npy = state["numpy"]
    if isinstance(npy, dict):
        npy = (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    np.random.set_state(npy)
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
    """The checkpoint dict; ``TypeError`` naming the key if any part is not tensors and plain data."""
    ckpt = {
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
    plain_data(ckpt)
    return ckpt


def signature_differences(expected: dict, found: dict) -> list[str]:
    """Differences between two model signatures that make the weights unloadable (num_params is informative), one
    line per input that differs. Inputs of the same shapes that mean other things differ by ``layout`` (a file
    without names predates them: not compared)."""
    keys = ("obs_shapes", "conv", *(("layout",) if "layout" in expected and "layout" in found else ()))
    return [line for key in keys for line in _differences(key, found.get(key), expected.get(key))]


def _differences(key: str, found: Any, expected: Any) -> list[str]:
    """Short lines for what differs between the file's and this model's signature entry (per input for dicts)."""
    if found == expected:
        return []
    if not (isinstance(found, dict) and isinstance(expected, dict)):
        return [f"{key}: checkpoint has {found}, this model has {expected}"]
    out = [f"{key}: the file's {sorted(set(found) - set(expected))} are not in this model"] \
        if set(found) - set(expected) else []
    if set(expected) - set(found):
        out.append(f"{key}: this model's {sorted(set(expected) - set(found))} are not in the file")
    return out + [f"{key}.{k}: checkpoint has {found[k]}, this model has {expected[k]}"
                  for k in sorted(set(found) & set(expected)) if found[k] != expected[k]]


def read_safely(path: str | Path, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load`` of ``path`` that builds only tensors and plain data (format 1's numpy RNG array aside);
    :class:`CheckpointError` naming the file for anything else: nothing in the file is run."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"checkpoint {path} is not a torch.save file (no zip archive: truncated, or written by "
                              "another tool); pass a carl-train checkpoint such as runs/<run>/last.pt")
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = ", ".join(_unsafe_globals(path)) or str(exc).splitlines()[0]
        raise CheckpointError(
            f"checkpoint {path} asks to build Python objects other than tensors and plain data ({found}); carl never runs "
            "code from a file, so it is refused. A carl checkpoint holds none: this file was made by another tool or "
            "crafted. If you wrote it yourself and trust it, load it in Python and save the tensors again "
            "(docs/security.md)") from None
    except Exception as exc:  # noqa: BLE001 - a torn or foreign archive fails in many ways
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); use another checkpoint of the run "
                              "(last.pt, best.pt, update_<n>.pt)") from None


def _unsafe_globals(path: Path) -> list[str]:
    """The Python objects the file's pickle names beyond the allowed ones (read, never built)."""
    try:
        allowed = {g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}" for g in _NUMPY_ARRAY_GLOBALS}
        return [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in allowed]
    except Exception:  # noqa: BLE001 - only for the message
        return []


REQUIRED = {"signature": dict, "model": dict, "optimizer": dict, "update": int, "global_step": int, "rng": dict,
            "env": dict, "config": dict, "extra": dict}


def load_checkpoint(path: str | Path, signature: dict | None = None, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and check a checkpoint; raise :class:`CheckpointError` naming ``path`` on any problem."""
    path = Path(path)
    ckpt = read_safely(path, map_location)
    if not isinstance(ckpt, dict) or "format_version" not in ckpt:
        raise CheckpointError(f"checkpoint {path} is not a carl checkpoint (no format_version); pass a carl-train "
                              "checkpoint such as runs/<run>/last.pt")
    version = ckpt["format_version"]
    if version not in READABLE_VERSIONS:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise CheckpointError(
            f"checkpoint {path} has format version {version!r}, this code reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; "
            + ("update carl (pip install -U / git pull) to read it" if newer else "it was not written by carl-train"))
    bad = [f"{k} (expected {t.__name__}, found {type(ckpt.get(k)).__name__})" for k, t in REQUIRED.items()
           if not isinstance(ckpt.get(k), t)]
    if bad:
        raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(bad)}; use another checkpoint of the run")
    if signature is not None:
        diffs = signature_differences(signature, ckpt.get("signature", {}))
        if diffs:
            raise CheckpointError(f"checkpoint {path} belongs to another model: " + "; ".join(diffs)
                                  + "; build the model and env options it was saved with (the run's config.yaml), or "
                                    "start a new run (run_dir=) for the new ones")
    return ckpt


def restore(ckpt: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, rng: bool = True) -> None:
    """Load weights (strict), optimiser state and RNG states from a loaded checkpoint."""
    model.load_state_dict(ckpt["model"])
    if optimizer is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if rng:
        restore_rng(ckpt["rng"])
