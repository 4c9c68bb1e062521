"""CARLA world -> the built-in simulator's state language: the map, the route bank and the actor tensors.

CARLA is left-handed (x forward, y right, yaw clockwise in degrees); the simulator is right-handed (``(x, y)_ours =
(x, -y)_carla``, yaw counter-clockwise in radians), see :mod:`envs.maps.opendrive`. Background actors in CARLA have
no lane coordinates, so only the fields the observation and infraction code read are filled: ``xy``, ``yaw``,
``speed``, ``half``, ``valid`` and ``lights`` for vehicles (CARLA's ``VehicleLightState`` mapped onto the simulator's
``LIGHT_*`` bits by :func:`lights_from_carla`), plus ``moving`` for pedestrians.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from envs.maps.lanegraph import LaneGraph
from envs.maps.opendrive import carla_to_world, carla_yaw_to_world, load_town
from envs.maps.routes import parse_leaderboard_xml
from envs.sim.agents import (LIGHT_BRAKE, LIGHT_EMERGENCY, LIGHT_LEFT_BLINKER, LIGHT_RIGHT_BLINKER, PEDESTRIAN_HALF,
                              Pedestrians, Vehicles)
from envs.sim.config import SimConfig
from envs.sim.world import map_routes
from envs.sim.world import World, build_world

# carla.VehicleLightState bits (0.9.16) that CaRL's BEV draws
CARLA_LIGHT_BRAKE, CARLA_LIGHT_RIGHT_BLINKER, CARLA_LIGHT_LEFT_BLINKER = 8, 16, 32
CARLA_LIGHT_SPECIAL1, CARLA_LIGHT_SPECIAL2 = 512, 1024  # sirens / beacons of special vehicles


def lights_from_carla(flags: Sequence[int] | np.ndarray, emergency: Sequence[bool] | np.ndarray | None = None
                      ) -> np.ndarray:
    """``carla.VehicleLightState`` flags [N] -> the simulator's ``LIGHT_*`` bitmask [N] (int32).

    Brake -> ``LIGHT_BRAKE``, LeftBlinker -> ``LIGHT_LEFT_BLINKER``, RightBlinker -> ``LIGHT_RIGHT_BLINKER``;
    Special1 or Special2 -> ``LIGHT_EMERGENCY``, but only for vehicles whose blueprint has ``special_type ==
    'emergency'`` (``emergency`` [N]; as CaRL's BEV). Other bits (position, beams, fog, ...) are dropped."""
    f = np.asarray(flags, np.int64).reshape(-1)
    out = np.where(f & CARLA_LIGHT_BRAKE, LIGHT_BRAKE, 0)
    out |= np.where(f & CARLA_LIGHT_LEFT_BLINKER, LIGHT_LEFT_BLINKER, 0)
    out |= np.where(f & CARLA_LIGHT_RIGHT_BLINKER, LIGHT_RIGHT_BLINKER, 0)
    if emergency is not None:
        special = (f & (CARLA_LIGHT_SPECIAL1 | CARLA_LIGHT_SPECIAL2)) != 0
        out |= np.where(special & np.asarray(emergency, bool).reshape(-1), LIGHT_EMERGENCY, 0)
    return out.astype(np.int32)


def vehicle_lights(states: Mapping[int, Any], ids: Sequence[int], emergency: Sequence[bool] | None = None
                   ) -> np.ndarray:
    """The ``LIGHT_*`` bitmask [N] of vehicles ``ids`` from ``world.get_vehicles_light_states()`` (one RPC for all
    vehicles; ``Vehicle.get_light_state()`` would cost one RPC per vehicle). A vehicle missing from ``states``: 0."""
    return lights_from_carla([int(states.get(i, 0)) for i in ids], emergency)


def is_emergency(actor: Any) -> bool:
    """Whether a CARLA vehicle is an emergency vehicle (blueprint attribute ``special_type``; no RPC)."""
    try:
        return actor.attributes.get("special_type", "") == "emergency"
    except (AttributeError, RuntimeError):
        return False


def graph_from_xodr(xodr: str, town: str, cache_dir: str | Path | None = None) -> LaneGraph:
    """Compile OpenDRIVE text (``world.get_map().to_opendrive()``) into a :class:`LaneGraph`.

    Goes through :func:`envs.maps.opendrive.load_town` on a temporary copy, so the compiled graph is cached under
    the text's hash and a server serving the same Town file as ``../shared/data/carla/maps`` hits the same cache.
    """
    with tempfile.TemporaryDirectory(prefix="carl-xodr-") as d:
        (Path(d) / f"{town}.xodr").write_text(xodr)
        return load_town(town, maps_dir=d, cache_dir=cache_dir)


def route_towns(route_file: str) -> list[str]:
    """Towns a Leaderboard route file uses, in first-appearance order."""
    return list(dict.fromkeys(t for _, t, _ in parse_leaderboard_xml(route_file)))


def build_carla_world(graph: LaneGraph, town: str, cfg: SimConfig, device: torch.device) -> World:
    return build_world(graph, map_routes(graph, town, cfg, key="env.options.town", noun="town"), cfg, device)


def ego_frame_velocity(vx: float, vy: float, yaw_deg: float) -> np.ndarray:
    """CARLA velocity (world frame, m/s) of a vehicle with CARLA yaw ``yaw_deg`` -> ``[forward, left]`` in the vehicle's
    frame (float32), the simulator's ``ego_vel_local``; includes side slip, as CARLA's centre-of-mass velocity does."""
    wx, wy = carla_to_world(float(vx), float(vy))
    yaw = float(carla_yaw_to_world(float(yaw_deg)))
    c, s = np.cos(yaw), np.sin(yaw)
    return np.array([wx * c + wy * s, -wx * s + wy * c], np.float32)


@dataclass
class Reading:
    """Poses of one kind of actor at one tick, in OUR frame: xy [N, 2], yaw [N], speed [N], half [N, 2], and the
    vehicles' ``LIGHT_*`` bitmask lights [N] (int32; zeros when not read, and for walkers)."""

    xy: np.ndarray
    yaw: np.ndarray
    speed: np.ndarray
    half: np.ndarray
    lights: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.xy)
        self.lights = (np.zeros(n, np.int32) if self.lights is None
                       else np.asarray(self.lights, np.int32).reshape(-1))
        if len(self.lights) != n:
            raise ValueError(f"Reading: {len(self.lights)} light states for {n} actors")

    @classmethod
    def empty(cls) -> "Reading":
        return cls(np.zeros((0, 2), np.float32), np.zeros(0, np.float32), np.zeros(0, np.float32),
                   np.zeros((0, 2), np.float32))

    @classmethod
    def from_carla(cls, x: np.ndarray, y: np.ndarray, yaw_deg: np.ndarray, vx: np.ndarray, vy: np.ndarray,
                   half: np.ndarray, lights: np.ndarray | None = None) -> "Reading":
        """From CARLA-frame arrays (positions, yaw in degrees, velocity, bounding-box half extents [N, 2]) and the
        ``LIGHT_*`` bitmask [N] (see :func:`lights_from_carla`; None: all off)."""
        wx, wy = carla_to_world(np.asarray(x, np.float64), np.asarray(y, np.float64))
        return cls(np.stack([wx, wy], -1).astype(np.float32).reshape(-1, 2),
                   np.asarray(carla_yaw_to_world(np.asarray(yaw_deg, np.float64)), np.float32).reshape(-1),
                   np.hypot(vx, vy).astype(np.float32).reshape(-1), np.asarray(half, np.float32).reshape(-1, 2),
                   lights)

    def nearest(self, centre: np.ndarray, n: int) -> tuple["Reading", np.ndarray]:
        """The ``n`` actors nearest to ``centre`` (padded), and the validity mask [n]."""
        order = np.argsort(np.linalg.norm(self.xy - centre, axis=-1))[:n] if len(self.xy) else np.zeros(0, int)
        k = len(order)
        pad = lambda a: np.concatenate([a[order], np.zeros((n - k, *a.shape[1:]), a.dtype)])  # noqa: E731
        valid = np.arange(n) < k
        return Reading(pad(self.xy), pad(self.yaw), pad(self.speed), pad(self.half), pad(self.lights)), valid


def _nearest_rows(reading: Reading, ego_xy: torch.Tensor, n: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The ``n`` actors of ``reading`` nearest the ego as batch-of-one tensors ([1, n]), with their validity."""
    r, valid = reading.nearest(ego_xy[0].cpu().numpy(), n)
    rows = {k: torch.as_tensor(getattr(r, k), device=device).unsqueeze(0) for k in ("xy", "yaw", "speed", "half")}
    rows["lights"] = torch.as_tensor(r.lights, dtype=torch.int32, device=device).unsqueeze(0)
    rows["valid"] = torch.as_tensor(valid, device=device).unsqueeze(0)
    return rows


def fill_vehicles(veh: Vehicles, reading: Reading, ego_xy: torch.Tensor) -> None:
    """Write the nearest vehicles of ``reading`` into the batch-of-one tensors ``veh`` ([1, N])."""
    rows = _nearest_rows(reading, ego_xy, veh.xy.shape[1], veh.xy.device)
    veh.xy, veh.yaw, veh.speed, veh.half = rows["xy"], rows["yaw"], rows["speed"], rows["half"]
    veh.valid, veh.lights = rows["valid"], rows["lights"]


def fill_pedestrians(ped: Pedestrians, reading: Reading, ego_xy: torch.Tensor, moving_speed: float = 0.1) -> None:
    """Write the nearest walkers of ``reading`` into ``ped`` ([1, P]); ``moving`` = faster than ``moving_speed``."""
    rows = _nearest_rows(reading, ego_xy, ped.xy.shape[1], ped.xy.device)
    ped.xy, ped.yaw, ped.speed, ped.valid = rows["xy"], rows["yaw"], rows["speed"], rows["valid"]
    ped.moving = ped.speed > moving_speed


__all__ = ["PEDESTRIAN_HALF", "Reading", "build_carla_world", "fill_pedestrians", "fill_vehicles", "graph_from_xodr",
           "ego_frame_velocity", "is_emergency", "lights_from_carla", "route_towns", "vehicle_lights"]
