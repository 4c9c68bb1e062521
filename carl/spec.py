"""What a policy bundle's ``spec.json`` says (the format: :mod:`carl.bundle`): the observations the actor reads, their
names and geometry (the BEV's view, or the vector observation's sizes), the actions and their meaning, the model
signature, the versions, the source; :func:`make_spec` writes it for a network and its training config."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import torch

from carl.config import sim_options
from carl.policy import ActorCritic, CarlPolicy
from envs import options_schema
from envs.api import (ACTIONS, BEV_CHANNELS, CONTROL_DT, LAYOUT_CARLA, LAYOUT_VECTOR, MEASUREMENTS,
                      NUPLAN_ACTION_SCALING, OBS_BEV, OBS_MEASUREMENTS, OBS_ROUTE, OBS_VALUE_MEASUREMENTS,
                      VALUE_MEASUREMENTS, VECTOR_FEATURES, VECTOR_SETS, layout_of)

BUNDLE_FORMAT = "carl-policy-bundle"
BUNDLE_VERSION = 1
FILES = {"torchscript": "policy.ts", "onnx": "policy.onnx", "weights": "weights.safetensors",
         "config": "config.yaml", "spec": "spec.json"}
ONNX_INPUTS = (OBS_BEV, OBS_MEASUREMENTS)  # the actor inputs of bundles written before spec.json listed them
ONNX_OUTPUTS = ("action", "alpha", "beta")


def git_commit(repo: Path = Path(__file__).resolve().parent.parent) -> str:
    """The checkout's commit (``-dirty`` with uncommitted changes to tracked files); in a ``git archive`` copy, the
    commit it was made from (``carl/.git_archival.txt``); ``unknown`` otherwise."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return _archived_commit(repo / "carl" / ".git_archival.txt")
    return f"{head}-dirty" if dirty else head


def _archived_commit(path: Path) -> str:
    """The commit ``git archive`` wrote into ``path`` (``node: <sha>``); ``unknown`` without one (a plain copy)."""
    try:
        found = re.fullmatch(r"node: ([0-9a-f]{40})\s*", path.read_text())
    except OSError:
        return "unknown"
    return found.group(1)[:12] if found else "unknown"


def carl_version() -> str:
    try:
        from importlib.metadata import version

        return version("carl")
    except Exception:  # noqa: BLE001 - not installed (PYTHONPATH checkout)
        return "unknown"


def bev_geometry(config: dict[str, Any], bev_size: int) -> dict[str, Any]:
    """BEV geometry from the training config's env options (the sim's defaults where unset)."""
    env = config.get("env", {}) or {}
    opts = sim_options(env.get("options"))
    defaults = options_schema("sim")()  # the simulator's BEV geometry where the config leaves it unset
    ppm = float(opts.get("bev_ppm", defaults.bev_ppm))
    from_bottom = int(opts.get("bev_ego_from_bottom", defaults.bev_ego_from_bottom))
    return {
        "bev_size": bev_size, "bev_ppm": ppm, "bev_ego_from_bottom": from_bottom,
        "metres_ahead": (bev_size - from_bottom) / ppm, "metres_behind": from_bottom / ppm,
        "metres_across": bev_size / ppm,
        "frame": "ego-centred, ego heading points up (row 0 is ahead); ego at row bev_size-1-bev_ego_from_bottom, "
                 "centre column",
        "env": env.get("name", "sim"),
    }


# What each action component does, by backend family and name (the bundle's "actions.fields").
_SIM_ACTION_MEANINGS = {"steer": "front-wheel angle = steer * max_steer (sim: 0.6 rad); positive increases the yaw (a "
                                 "right turn in CARLA's left-handed frame)",
                        "longitudinal": "throttle = max(a, 0), brake = max(-a, 0)"}
_NUPLAN_ACTION_MEANINGS = {
    "accel": "target acceleration = a * {positive_mps2} m/s^2 for a >= 0, a * {negative_mps2} m/s^2 for a < 0 "
             "(nuPlan's kinematic bicycle, 0.2 s lag; a reverse guard brakes to a stop instead of reversing)",
    "steer": "target tire steering angle = a * {max_tire_angle_rad} rad, positive to the left; commanded as the rate "
             "(target - current) / 0.1 s (0.05 s lag)",
}


def _layout_names(policy: ActorCritic, key: str, default: tuple[str, ...], size: int) -> list[str] | None:
    """The names the policy was trained with, else the CARLA layout's where the size fits (older files)."""
    names = policy.layout.get(key)
    return list(names) if names else (list(default) if size == len(default) else None)


def action_fields(names: list[str], env_name: str) -> list[dict[str, Any]]:
    """``actions.fields`` of a bundle: name, meaning and (nuPlan) scaling of each action component, in order."""
    out = []
    for name in names:
        key = "accel" if name == "longitudinal" else name  # nuPlan's longitudinal component is its acceleration
        if env_name == "nuplan" and key in NUPLAN_ACTION_SCALING:
            scale = NUPLAN_ACTION_SCALING[key]
            out.append({"name": name, "meaning": _NUPLAN_ACTION_MEANINGS[key].format(**scale), "scaling": dict(scale)})
        else:
            out.append({"name": name, "meaning": _SIM_ACTION_MEANINGS.get(name, "")})
    return out


def control_dt_of(ckpt: dict[str, Any]) -> float:
    """The control step of the env a checkpoint was trained on (older checkpoints: CaRL's 0.1 s, all they used)."""
    return float((ckpt.get("extra") or {}).get("control_dt", CONTROL_DT))


def make_spec(policy: ActorCritic, config: dict[str, Any], source: dict[str, Any], bev_dtype: str = "uint8",
              control_dt: float = CONTROL_DT) -> dict[str, Any]:
    """The ``spec.json`` content for ``policy`` trained with ``config`` on an env stepping ``control_dt`` seconds
    (checkpoints record it; older ones were all trained at CaRL's 0.1 s)."""
    shapes = {k: list(v) for k, v in policy.obs_shapes.items()}
    env_name = str((config.get("env") or {}).get("name", "sim"))
    actions = list(policy.layout.get("actions") or ACTIONS)
    inputs = policy.INPUTS  # the exported actor's positional inputs, in order
    measurements = {"shape": shapes[OBS_MEASUREMENTS], "dtype": "float32",
                    "fields": _layout_names(policy, OBS_MEASUREMENTS, MEASUREMENTS, shapes[OBS_MEASUREMENTS][0])}
    if isinstance(policy, CarlPolicy):
        c, h, _ = shapes[OBS_BEV]
        channels = _layout_names(policy, OBS_BEV, BEV_CHANNELS, c) or [f"channel_{i}" for i in range(c)]
        layout = layout_of(policy.layout[OBS_BEV]) if policy.layout.get(OBS_BEV) else \
            (LAYOUT_CARLA if c == len(BEV_CHANNELS) else "custom")
        observations = {OBS_BEV: {"shape": shapes[OBS_BEV], "dtype": bev_dtype, "range": [0, 255], "channels": channels,
                                  "note": "the network divides by 255; float inputs must keep the 0..255 scale"},
                        OBS_MEASUREMENTS: measurements}
        geometry = {"bev_geometry": bev_geometry(config, h)}
    else:
        layout = LAYOUT_VECTOR
        observations = {OBS_MEASUREMENTS: measurements, **{
            k: {"shape": shapes[k], "dtype": "float32", "fields": _layout_names(policy, k, VECTOR_FEATURES[k],
                                                                                shapes[k][1]),
                "note": "entities in the ego frame (x forward, y left), nearest first; the last field is the "
                        "validity flag and padding rows are all zero"} for k in VECTOR_SETS}}
        geometry = {"vector_geometry": vector_geometry(config, shapes)}
    return {
        "format": BUNDLE_FORMAT,
        "bundle_version": BUNDLE_VERSION,
        "carl_version": carl_version(),
        "torch_version": torch.__version__,
        "observation_layout": layout,
        "inputs": list(inputs),
        "observations": observations,
        "critic_observations": {OBS_VALUE_MEASUREMENTS: {
            "shape": shapes[OBS_VALUE_MEASUREMENTS], "dtype": "float32",
            "fields": _layout_names(policy, OBS_VALUE_MEASUREMENTS, VALUE_MEASUREMENTS,
                                    shapes[OBS_VALUE_MEASUREMENTS][0]),
            "note": "value head only; not an input of the actor"}},
        "actions": {
            "shape": [2], "dtype": "float32", "range": [-1.0, 1.0],
            "fields": action_fields(actions, env_name),
            "distribution": "Beta(alpha, beta) on [0, 1] mapped to [-1, 1] by a = 2x - 1",
            "deterministic": "Beta mean: a = 2 * alpha / (alpha + beta) - 1",
            "control_period_s": control_dt,
        },
        **geometry,
        "model": {**{k: v for k, v in (config.get("model") or {"name": "carl"}).items()},
                  "signature": policy.signature()},
        "onnx": {"inputs": list(inputs), "outputs": list(ONNX_OUTPUTS), "dynamic_axes": {"batch": 0}},
        "files": {k: v for k, v in FILES.items() if k != "spec"},
        "source": source,
    }


def vector_geometry(config: dict[str, Any], shapes: dict[str, list[int]]) -> dict[str, Any]:
    """The vector observation's sizes the policy was trained with (``env.options.vector``, the simulator's defaults
    where unset; the entity counts from the network's input shapes): what an evaluation env must use."""
    opts = dict(sim_options((config.get("env") or {}).get("options")).get("vector") or {})
    defaults = options_schema("sim")().vector
    out = {f: opts.get(f, getattr(defaults, f)) for f in vars(defaults)}
    out.update({("route_points" if k == OBS_ROUTE else k): shapes[k][0] for k in VECTOR_SETS})  # the counts
    return out


def sha256_file(path: str | Path) -> str:
    """The file's sha256 (hex), read in 1 MiB blocks: the bundle's manifest checks each file by it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
