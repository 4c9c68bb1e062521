"""A stand-in CARLA 0.9.16 server for tests: it speaks the wire protocol, it is NOT a simulator.

This process exists only to test our CARLA integration (the env worker, the server manager, crash recovery) with the
unmodified ``carla==0.9.16`` client where no CARLA server can run (CI, laptops). It does not replace CARLA: there is
no rendering, no sensors, no collision physics, no walker navigation and no CARLA Traffic Manager behaviour beyond
applying the controls the client-side TM sends. Vehicles move with the built-in simulator's kinematic bicycle
(``envs/sim/dynamics.py``, its default car) so that a policy sees the same first observations here and in
the built-in simulator; walkers move in a straight line with their last ``WalkerControl``. Traffic lights: one
``traffic.traffic_light`` actor per signalised stop line of the map (the simulator's light groups and phases),
cycling green -> yellow -> red per junction phase on simulation time; ``set_state`` / ``freeze`` work. Vehicle light
states (``carla.VehicleLightState`` bits) are kept per vehicle as CARLA keeps them: set by ``Vehicle.set_light_state``
or by the client-side Traffic Manager's ``SetVehicleLightState`` commands (``update_vehicle_lights``), read with
``World.get_vehicles_light_states`` / ``Vehicle.get_light_state``.

The process exits when its parent process goes away (``--no-parent-watch`` turns that off), so a stand-in never
outlives the test or launcher that started it.

Protocol (``docs/carla.md`` and the shared client notes, section 5): msgpack-RPC over TCP on the RPC port (every
request carries a leading metadata argument; results are wrapped as ``carla::rpc::Response``), and one TCP connection
per stream on the streaming port (the client sends the 4-byte stream id, then reads ``[u32 length][payload]`` frames).
The world state is the "episode state" stream (sensor type 17): a 48-byte sensor header, a 36-byte episode header and
119 bytes per actor. The binary layouts are specific to the 0.9.16 client.

A test-only tool, not part of the installed packages: run it from a repository checkout, as
``python tests/support/carla_standin.py --port 2000 --map Town01.xodr`` (or ``python -m tests.support.carla_standin``
from the repository root). It also accepts ``CarlaUE4.sh`` flags such as ``-carla-rpc-port=2000
-carla-streaming-port=2001``, so it can stand in for the executable in the server manager
(``tests.support.processes.standin_executable``). Run by path, it puts the repository root on ``sys.path`` itself to
import the map compiler from ``envs`` (numpy only, no torch).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np

log = logging.getLogger("carla-standin")

VERSION = "0.9.16"
EPISODE_STATE_SENSOR = 17  # SensorRegistry index of the episode-state serializer in 0.9.16
STREAM_ID = 1
SPECTATOR_ID = 1
FIRST_ACTOR_ID = 100
# WorldSettings defaults (0.9.16 field order)
DEFAULT_SETTINGS = [False, False, [False], False, 0.01, 10, 0.0, True, 3000.0, 2000.0, False]
SPEED_LIMIT_KMH = 30.0
ATTR_BOOL, ATTR_INT, ATTR_FLOAT, ATTR_STRING = 1, 2, 3, 4  # attribute type codes on the 0.9.16 wire
# traffic lights: carla.TrafficLightState codes, and the stand-in's cycle (seconds) per junction phase
TL_RED, TL_YELLOW, TL_GREEN, TL_OFF = 0, 1, 2, 3
TL_GREEN_TIME, TL_YELLOW_TIME, TL_ALL_RED_TIME = 10.0, 3.0, 1.0
TL_TAG = b"\x12"  # semantic tag 18 = TrafficLight
CMD_SET_VEHICLE_LIGHT_STATE = 18  # carla::rpc::Command variant index of SetVehicleLightState [id, u32 flags] (0.9.16)
PARENT_POLL_S = 0.25
REPO_ROOT = Path(__file__).resolve().parents[2]  # tests/support/carla_standin.py -> the checkout holding envs/
if str(REPO_ROOT) not in sys.path:  # run as a script, sys.path holds tests/support only
    sys.path.insert(0, str(REPO_ROOT))

from envs.sim.dynamics import GEAR_UP_SPEEDS, Car, bicycle_step  # noqa: E402 - needs the path above; no torch

CAR = Car()  # vehicles drive as the built-in simulator's ego with its default car


def _attr(name: str, kind: int, value: str, recommended: list[str] | None = None, modifiable: bool = False) -> list:
    return [name, kind, value, recommended or [], modifiable, False]


def _blueprints() -> dict[str, tuple[str, list, tuple[float, float, float]]]:
    """id -> (tags, attributes, bounding-box half extent)."""
    role = _attr("role_name", ATTR_STRING, "autopilot", ["autopilot", "scenario", "ego", "hero"], True)
    out: dict[str, tuple[str, list, tuple[float, float, float]]] = {}
    for bp, ext in (("vehicle.lincoln.mkz_2020", (2.45, 1.05, 0.75)), ("vehicle.tesla.model3", (2.4, 1.05, 0.75)),
                    ("vehicle.audi.a2", (1.85, 0.9, 0.8)), ("vehicle.nissan.patrol", (2.3, 0.95, 0.95))):
        attrs = [_attr("number_of_wheels", ATTR_INT, "4"), _attr("base_type", ATTR_STRING, "car"),
                 _attr("generation", ATTR_INT, "2"), role]
        out[bp] = ("vehicle," + ",".join(bp.split(".")[1:]), attrs, ext)
    for i in (1, 2, 3):
        bp = f"walker.pedestrian.{i:04d}"
        attrs = [_attr("is_invincible", ATTR_BOOL, "true", modifiable=True),
                 _attr("speed", ATTR_FLOAT, "1.4", ["1.4", "2.0"], True), _attr("age", ATTR_STRING, "adult"),
                 _attr("generation", ATTR_INT, "2"), role]
        out[bp] = (f"walker,pedestrian,{i:04d}", attrs, (0.3, 0.3, 0.9))
    # what route scenarios spawn (envs/carla/scenarios.py): an emergency vehicle, a bicycle and a static prop
    out["vehicle.ford.ambulance"] = ("vehicle,ford,ambulance", [
        _attr("number_of_wheels", ATTR_INT, "4"), _attr("base_type", ATTR_STRING, "van"),
        _attr("special_type", ATTR_STRING, "emergency"), _attr("generation", ATTR_INT, "2"), role], (3.2, 1.2, 1.4))
    out["vehicle.diamondback.century"] = ("vehicle,diamondback,century", [
        _attr("number_of_wheels", ATTR_INT, "2"), _attr("base_type", ATTR_STRING, "bicycle"),
        _attr("generation", ATTR_INT, "1"), role], (0.8, 0.2, 0.8))
    out["static.prop.vendingmachine"] = ("static,prop,vendingmachine", [role], (0.5, 0.6, 1.0))
    out["sensor.other.collision"] = ("sensor,other,collision", [role], (0.0, 0.0, 0.0))
    return out


@dataclass
class Actor:
    """One actor, pose in CARLA's left-handed frame (degrees), speed along the velocity (heading + side slip)."""

    id: int
    type_id: str
    attributes: list  # [[id, type, value]] as sent by the client
    extent: tuple[float, float, float]
    x: float
    y: float
    z: float
    yaw: float  # degrees, CARLA convention
    pitch: float = 0.0
    roll: float = 0.0
    speed: float = 0.0
    control: list = field(default_factory=lambda: [0.0, 0.0, 0.0, False, False, False, 0])
    walker_dir: tuple[float, float, float] = (0.0, 0.0, 0.0)
    light_state: int = 0  # carla.VehicleLightState flags as last set by the client (CARLA changes them on request)
    slip: float = 0.0  # side-slip angle of the last step (rad, our frame): the velocity points along yaw + slip

    @property
    def is_vehicle(self) -> bool:
        return self.type_id.startswith("vehicle.")

    @property
    def is_walker(self) -> bool:
        return self.type_id.startswith("walker.")

    def rpc(self) -> list:
        """``carla::rpc::Actor``: semantic tags and stream token must be msgpack bin."""
        bbox = [[0.0, 0.0, self.extent[2]], list(self.extent), [0.0, 0.0, 0.0]]
        return [self.id, 0, [0, self.type_id, self.attributes], bbox, b"\x0e" if self.is_vehicle else b"",
                b""]  # an empty stream token: not a sensor

    def step(self, dt: float) -> None:
        """Kinematic bicycle (the built-in simulator's ego model) for vehicles; straight walking for walkers."""
        if self.is_walker:
            dx, dy, _ = self.walker_dir
            self.x += dx * self.speed * dt
            self.y += dy * self.speed * dt
            if self.speed > 0 and (dx or dy):
                self.yaw = math.degrees(math.atan2(dy, dx))
            return
        if not self.is_vehicle:
            return
        throttle, steer, brake = (float(v) if v == v else 0.0 for v in self.control[:3])  # NaN -> 0
        steer_ours = -max(-1.0, min(1.0, steer))  # CARLA steers right for positive values; our frame is mirrored
        xy, yaw_ours, speed, slip = bicycle_step(np, CAR, np.array([self.x, -self.y]), -math.radians(self.yaw),
                                                 self.speed, steer_ours, throttle, brake, dt)
        yaw_ours = (yaw_ours + math.pi) % (2 * math.pi) - math.pi
        self.x, self.y, self.yaw = float(xy[0]), -float(xy[1]), -math.degrees(yaw_ours)
        self.speed, self.slip = float(speed), float(slip)

    def gear(self) -> int:
        """The gear CARLA reports in the vehicle's control: the client's with manual shifting, else the automatic
        gearbox's (here the simulator's: 1 at standstill, up-shifting at ``GEAR_UP_SPEEDS``)."""
        if self.control[5]:  # manual_gear_shift
            return int(self.control[6])
        return 1 + sum(self.speed > g for g in GEAR_UP_SPEEDS)

    def record(self) -> bytes:
        """One 119-byte ``ActorDynamicState`` record (0.9.16 layout)."""
        rad = math.radians(self.yaw) - self.slip  # CARLA's frame is mirrored: our yaw + slip = -(CARLA yaw - slip)
        if self.is_walker:
            vx, vy = self.walker_dir[0] * self.speed, self.walker_dir[1] * self.speed
        else:
            vx, vy = math.cos(rad) * self.speed, math.sin(rad) * self.speed
        head = struct.pack("<IB6f3f3f3f", self.id, 1, self.x, self.y, self.z, self.pitch, self.yaw, self.roll,
                           vx, vy, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        if self.is_vehicle:
            c = self.control
            union = struct.pack("<3f3?if", float(c[0]), float(c[1]), float(c[2]), bool(c[3]), bool(c[4]), bool(c[5]),
                                self.gear(), SPEED_LIMIT_KMH)
        else:
            union = b""
        return head + union.ljust(54, b"\0")


@dataclass
class TrafficLight(Actor):
    """A light on one stop line: phase ``phase`` of ``num_phases`` at its junction (the map's light groups); the
    trigger volume (``bounding_box``) lies on the stop line in the actor's frame."""

    sign_id: str = ""
    group: int = -1  # the map's light group (lights of one group always show the same colour)
    junction: int = 0
    phase: int = 0
    num_phases: int = 1
    offset: float = 0.0  # junction cycle offset (s)
    green_time: float = TL_GREEN_TIME
    yellow_time: float = TL_YELLOW_TIME
    pole_index: int = 0
    override: int | None = None  # a state set through set_state: held until the cycle changes colour (or frozen)
    override_base: int = TL_GREEN
    frozen_at: float | None = None  # simulation time the light was frozen at

    def rpc(self) -> list:
        bbox = [[0.0, 0.0, 1.0], list(self.extent), [0.0, 0.0, 0.0]]  # trigger volume, actor-local
        return [self.id, 0, [0, self.type_id, self.attributes], bbox, TL_TAG, b""]

    def step(self, dt: float) -> None:
        return

    @property
    def phase_len(self) -> float:
        return self.green_time + self.yellow_time + TL_ALL_RED_TIME

    @property
    def red_time(self) -> float:
        return self.num_phases * self.phase_len - self.green_time - self.yellow_time

    def cycle(self, t: float) -> tuple[int, float]:
        """(state, seconds in that state) of the cycle at simulation time ``t``."""
        t = self.frozen_at if self.frozen_at is not None else t
        cycle = self.num_phases * self.phase_len
        rel = (t + self.offset - self.phase * self.phase_len) % cycle
        if rel < self.green_time:
            return TL_GREEN, rel
        if rel < self.green_time + self.yellow_time:
            return TL_YELLOW, rel - self.green_time
        return TL_RED, rel - self.green_time - self.yellow_time

    def state_at(self, t: float) -> tuple[int, float]:
        state, elapsed = self.cycle(t)
        if self.override is not None:
            if self.frozen_at is None and state != self.override_base:
                self.override = None  # the cycle moved on: the set state ends, as in CARLA
            else:
                return self.override, 0.0
        return state, elapsed

    def record_at(self, t: float) -> bytes:
        state, elapsed = self.state_at(t)
        head = struct.pack("<IB6f3f3f3f", self.id, 1, self.x, self.y, self.z, self.pitch, self.yaw, self.roll,
                           *([0.0] * 9))
        union = struct.pack("<32s4fI?B", self.sign_id.encode()[:31], self.green_time, self.yellow_time,
                            self.red_time, elapsed, self.pole_index, self.frozen_at is not None, state)
        return head + union  # TrafficLightData fills the 54-byte union exactly


def map_lights(xodr: Path, first_id: int) -> list[TrafficLight]:
    """One light per signalised stop line of the town, from the simulator's compiled map (its light groups).

    Imports the map compiler from this repository (numpy and the offline ``carla.Map``; no torch)."""
    from envs.maps.lanegraph import CONTROL_LIGHT  # noqa: PLC0415
    from envs.maps.opendrive import load_town  # noqa: PLC0415

    g = load_town(xodr.stem, maps_dir=xodr.parent)
    out: list[TrafficLight] = []
    for k, (lane, control, group) in enumerate(zip(g.stop_lane, g.stop_control, g.stop_light_group)):
        if int(control) != CONTROL_LIGHT or group < 0:
            continue
        pts = g.lane_points(int(lane))
        (x, y), (px, py) = pts[-1], pts[-2]
        yaw = -math.degrees(math.atan2(y - py, x - px))  # ours -> CARLA: (x, -y), clockwise degrees
        junction = int(g.light_junction[group])
        half_w = float(g.width[int(lane)]) / 2
        out.append(TrafficLight(first_id + len(out), "traffic.traffic_light", [], (1.0, half_w, 1.0), float(x),
                                -float(y), 0.0, yaw, sign_id=f"standin-{k}", group=int(group), junction=junction,
                                phase=int(g.light_phase[group]), num_phases=max(1, int(g.light_num_phases[group])),
                                offset=(junction * 7.3) % 100.0, pole_index=len(out)))
    return out


class World:
    """The stand-in's whole state, guarded by one lock (RPC threads, stream threads)."""

    def __init__(self, maps: dict[str, Path], town: str, stream_port: int):
        self.maps, self.town = maps, town
        self.stream_port = stream_port
        self.lock = threading.RLock()
        self.episode = 1
        self.frame = 0
        self.elapsed = 0.0
        self.settings = list(DEFAULT_SETTINGS)
        self.actors: dict[int, Actor] = {}
        self.next_id = FIRST_ACTOR_ID
        self.tms: dict[int, str] = {}
        self.blueprints = _blueprints()
        self.subscribers: list[socket.socket] = []
        self.spectator = Actor(SPECTATOR_ID, "spectator", [], (0.0, 0.0, 0.0), 0.0, 0.0, 0.0, 0.0)
        self._xodr: dict[str, str] = {}
        self.lights: dict[int, TrafficLight] = {}
        self.load_lights()

    def load_lights(self) -> None:
        """Traffic-light actors of the current town (ids below the spawned actors'; a failure leaves none)."""
        try:
            lights = map_lights(self.maps[self.town], 10)
        except Exception:  # noqa: BLE001 - a map the compiler rejects still serves, without lights
            log.exception("no traffic lights for %s", self.town)
            lights = []
        self.lights = {tl.id: tl for tl in lights[: FIRST_ACTOR_ID - 10]}

    # -------------------------------------------------------------------------------- helpers
    def xodr(self) -> str:
        if self.town not in self._xodr:
            self._xodr[self.town] = self.maps[self.town].read_text()
        return self._xodr[self.town]

    def token(self) -> bytes:
        return struct.pack("<IHBB16s", STREAM_ID, self.stream_port, 1, 1, bytes([127, 0, 0, 1]) + bytes(12))

    def dt(self) -> float:
        fixed = self.settings[2]
        return float(fixed[1]) if isinstance(fixed, (list, tuple)) and len(fixed) > 1 and fixed[0] else 0.05

    def state_frame(self) -> bytes:
        actors = [self.spectator, *self.actors.values()]
        header = struct.pack("<QQd6f", EPISODE_STATE_SENSOR, self.frame, self.elapsed, 0, 0, 0, 0, 0, 0)
        episode = struct.pack("<Qdf3ii", self.episode, time.time(), self.dt(), 0, 0, 0, 0)
        payload = header + episode + b"".join(a.record() for a in actors) + b"".join(
            tl.record_at(self.elapsed) for tl in self.lights.values())
        return struct.pack("<I", len(payload)) + payload

    def broadcast(self) -> None:
        frame = self.state_frame()
        for s in list(self.subscribers):
            try:
                s.sendall(frame)
            except OSError:
                self.subscribers.remove(s)

    def tick(self) -> int:
        dt = self.dt()
        for a in self.actors.values():
            a.step(dt)
        self.frame += 1
        self.elapsed += dt
        self.broadcast()
        return self.frame

    def spawn(self, description: list, transform: list) -> Actor:
        _, type_id, attrs = description
        if type_id not in self.blueprints and not type_id.startswith("controller."):
            raise RpcFailure(f"unknown blueprint {type_id}")
        (x, y, z), (pitch, yaw, roll) = transform
        ext = self.blueprints.get(type_id, ("", [], (0.0, 0.0, 0.0)))[2]
        if type_id.startswith(("vehicle.", "walker.")):
            for other in self.actors.values():
                if other.type_id.startswith(("vehicle.", "walker.")) and math.hypot(other.x - x, other.y - y) < (
                        ext[0] + other.extent[0]) * 0.8:
                    raise RpcFailure("Spawn failed because of collision at spawn position")
        actor = Actor(self.next_id, type_id, attrs, ext, x, y, z, yaw, pitch, roll)
        self.next_id += 1
        self.actors[actor.id] = actor
        return actor

    def find(self, actor_id: int) -> Actor | None:
        if actor_id == SPECTATOR_ID:
            return self.spectator
        return self.actors.get(actor_id) or self.lights.get(actor_id)

    def light(self, actor_id: int) -> TrafficLight:
        tl = self.lights.get(actor_id)
        if tl is None:
            raise RpcFailure(f"actor {actor_id} is not a traffic light")
        return tl


class RpcFailure(Exception):
    """Turned into a ``carla::rpc::ResponseError`` (the client raises RuntimeError with the message)."""


def ok(value: Any) -> list:
    return [[1, value]]


VOID = [[False]]


def make_handlers(w: World, version: str = VERSION) -> dict[str, Callable[..., Any]]:
    """The RPC methods the env-worker path needs; each returns the msgpack-ready result."""

    def load_new_episode(name: str, reset_settings: bool = True, layers: int = 0xFFFF) -> list:
        town = name.rsplit("/", 1)[-1]
        if town not in w.maps:
            raise RpcFailure("map not found")
        w.town, w.actors, w.episode = town, {}, w.episode + 1
        w.load_lights()
        if reset_settings:
            w.settings = list(DEFAULT_SETTINGS)
        w.broadcast()
        return VOID

    def set_episode_settings(settings: list) -> list:
        w.settings = list(settings)
        w.broadcast()
        return ok(w.frame)

    def spawn_actor(description: list, transform: list, *_: Any) -> list:
        return ok(w.spawn(description, transform).rpc())

    def apply_control(actor_id: int, control: list) -> list:
        a = w.actors.get(actor_id)
        if a is not None and a.is_vehicle:
            a.control = list(control)
        return VOID

    def set_vehicle_lights(actor_id: int, state: Any) -> list:
        a = w.actors.get(actor_id)  # rpc::VehicleLightState is [u32]; the batch command carries the bare u32
        if a is not None and a.is_vehicle:
            a.light_state = int(state[0] if isinstance(state, (list, tuple)) else state) & 0xFFFFFFFF
        return VOID

    def get_vehicle_lights(actor_id: int) -> list:
        a = w.actors.get(actor_id)
        if a is None or not a.is_vehicle:
            raise RpcFailure(f"actor {actor_id} is not a vehicle")
        return ok([a.light_state])

    def apply_walker_control(actor_id: int, control: list) -> list:
        a = w.actors.get(actor_id)
        if a is not None and a.is_walker:
            (dx, dy, _), speed = control[0], float(control[1])
            norm = math.hypot(dx, dy) or 1.0
            a.walker_dir, a.speed = (dx / norm, dy / norm, 0.0), speed
        return VOID

    def destroy_actor(actor_id: int) -> list:
        return ok(w.actors.pop(actor_id, None) is not None)

    def bounding_box(actor_id: int) -> list:
        a = w.find(actor_id)  # an unknown id (the client-side TM asks after destroy) gets an empty box, no error:
        return ok(a.rpc()[3] if a is not None else [[0.0] * 3, [0.0] * 3, [0.0] * 3])  # an error aborts the client

    def actors_by_id(ids: list) -> list:
        return ok([a.rpc() for a in (w.find(i) for i in ids) if a is not None])

    def set_transform(actor_id: int, transform: list) -> list:
        a = w.find(actor_id)
        if a is not None:
            (a.x, a.y, a.z), (a.pitch, a.yaw, a.roll) = transform
        return VOID

    def apply_batch(commands: list, do_tick: bool = False) -> list:
        out = []
        for command in commands:  # Command = [variant]; variant = [index, payload]
            index, payload = command[0]
            if index == 2:  # ApplyVehicleControl [id, control]
                apply_control(payload[0], payload[1])
            elif index == CMD_SET_VEHICLE_LIGHT_STATE:  # [id, flags]: the Traffic Manager's light updates
                set_vehicle_lights(payload[0], payload[1])
            out.append([[1, payload[0] if isinstance(payload, list) and payload else 0]])
        if do_tick:
            w.tick()
        return out

    def set_light_state(actor_id: int, state: int) -> list:
        tl = w.light(actor_id)
        tl.override, tl.override_base = int(state), tl.cycle(w.elapsed)[0]
        return VOID

    def freeze_light(actor_id: int, frozen: bool) -> list:
        tl = w.light(actor_id)
        tl.frozen_at = w.elapsed if frozen else None
        return VOID

    def freeze_all(frozen: bool) -> list:
        for tl in w.lights.values():
            tl.frozen_at = w.elapsed if frozen else None
        return VOID

    def reset_all() -> list:
        for tl in w.lights.values():
            tl.override, tl.frozen_at = None, None
        return VOID

    def set_light_time(field_name: str) -> Callable[..., list]:
        def handler(actor_id: int, seconds: float) -> list:
            setattr(w.light(actor_id), field_name, float(seconds))
            return VOID
        return handler

    def group_lights(actor_id: int) -> list:
        tl = w.light(actor_id)
        return ok([o.id for o in w.lights.values() if o.junction == tl.junction])

    def light_boxes(actor_id: int) -> list:
        tl = w.light(actor_id)
        return ok([[[tl.x, tl.y, 3.0], [0.2, 0.2, 0.5], [0.0, 0.0, 0.0]]])

    def add_tm(info: list) -> list:
        ip, port = info
        new = port not in w.tms
        w.tms.setdefault(port, ip)
        return ok(new)

    return {
        "version": lambda: ok(version),
        "get_available_maps": lambda: ok([f"/Game/Carla/Maps/{t}" for t in sorted(w.maps)]),
        "load_new_episode": load_new_episode,
        "get_episode_info": lambda: ok([w.episode, [w.token()]]),
        "get_sensor_token": lambda stream_id: ok([w.token()]),
        "get_episode_settings": lambda: ok(w.settings),
        "set_episode_settings": set_episode_settings,
        "query_lights_state": lambda client: ok([]),
        "get_required_files": lambda folder="": ok([]),
        "get_map_info": lambda: ok([f"Carla/Maps/{w.town}", []]),
        "get_map_data": lambda: ok(w.xodr()),
        "tick_cue": lambda: ok(w.tick()),
        "get_actor_definitions": lambda: ok([[0, bp, tags, attrs] for bp, (tags, attrs, _) in w.blueprints.items()]),
        "spawn_actor": spawn_actor,
        "spawn_actor_with_parent": spawn_actor,
        "get_actor_bounding_box": bounding_box,
        "get_actors_by_id": actors_by_id,
        "apply_control_to_vehicle": apply_control,
        "apply_control_to_walker": apply_walker_control,
        "destroy_actor": destroy_actor,
        "set_actor_transform": set_transform,
        "get_spectator": lambda: ok(w.spectator.rpc()),
        "is_traffic_manager_running": lambda port: ok(port in w.tms),
        "add_traffic_manager_running": add_tm,
        "get_traffic_manager_running": lambda port: ok([w.tms.get(port, ""), port if port in w.tms else 0]),
        "destroy_traffic_manager": lambda port: ok(w.tms.pop(port, None) is not None),
        "set_actor_simulate_physics": lambda actor_id, enabled: VOID,
        "set_actor_autopilot": lambda actor_id, enabled: VOID,
        "get_vehicle_light_states": lambda: ok([[a.id, a.light_state] for a in w.actors.values() if a.is_vehicle]),
        "get_vehicle_light_state": get_vehicle_lights,
        "set_vehicle_light_state": set_vehicle_lights,
        "get_weather_parameters": lambda: ok([0.0] * 14),
        "apply_batch": apply_batch,
        "reset_all_traffic_lights": reset_all,
        "freeze_all_traffic_lights": freeze_all,
        "set_traffic_light_state": set_light_state,
        "freeze_traffic_light": freeze_light,
        "set_traffic_light_green_time": set_light_time("green_time"),
        "set_traffic_light_yellow_time": set_light_time("yellow_time"),
        "get_group_traffic_lights": group_lights,
        "reset_traffic_light_group": lambda actor_id: reset_all(),
        "get_light_boxes": light_boxes,
    }


class _RpcHandler(socketserver.BaseRequestHandler):
    """One msgpack-RPC connection: ``[0, msgid, method, [metadata, *args]]`` -> ``[1, msgid, error, result]``."""

    def handle(self) -> None:
        w: World = self.server.world  # type: ignore[attr-defined]
        handlers: dict[str, Callable[..., Any]] = self.server.handlers  # type: ignore[attr-defined]
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            unpacker.feed(data)
            for msg in unpacker:
                if not isinstance(msg, list) or len(msg) != 4 or msg[0] != 0:
                    continue  # notifications are not used by the client paths served here
                _, msgid, method, params = msg
                log.debug("rpc %s %r", method, params)
                args = params[1:] if params else []  # drop CARLA's metadata argument
                error, result = None, None
                fn = handlers.get(method)
                if fn is None:
                    log.warning("unsupported RPC %s%r", method, args)
                    error = f"stand-in: unsupported RPC '{method}'"
                else:
                    try:
                        with w.lock:
                            result = fn(*args)
                    except RpcFailure as e:
                        result = [[0, [str(e)]]]
                    except Exception as e:  # noqa: BLE001 - a bad request must not kill the server
                        log.exception("RPC %s failed", method)
                        error = f"stand-in: {method} failed: {e}"
                try:
                    sock.sendall(msgpack.packb([1, msgid, error, result], use_bin_type=True))
                except OSError:
                    return


class _StreamHandler(socketserver.BaseRequestHandler):
    """One stream connection: read the 4-byte stream id, then the world pushes frames until the client leaves."""

    def handle(self) -> None:
        w: World = self.server.world  # type: ignore[attr-defined]
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = b""
        while len(head) < 4:
            chunk = sock.recv(4 - len(head))
            if not chunk:
                return
            head += chunk
        (stream_id,) = struct.unpack("<I", head)
        log.debug("stream %d connected", stream_id)
        if stream_id != STREAM_ID:
            log.warning("client asked for unknown stream %d", stream_id)
            return
        with w.lock:
            w.subscribers.append(sock)
            sock.sendall(w.state_frame())
        while True:
            try:
                if not sock.recv(1024):
                    break
            except OSError:
                break
        with w.lock:
            if sock in w.subscribers:
                w.subscribers.remove(sock)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def _async_ticker(w: World, period: float = 0.05) -> None:
    """Asynchronous mode (CARLA's default): the world advances on its own, as a real server does."""
    while True:
        time.sleep(period)
        with w.lock:
            if not w.settings[0]:
                w.tick()


def serve(rpc_port: int, stream_port: int, maps: dict[str, Path], town: str, host: str = "127.0.0.1",
          version: str = VERSION) -> tuple[_Server, _Server]:
    """Start the RPC and streaming servers in background threads; returns them (call ``shutdown()`` to stop)."""
    world = World(maps, town, stream_port)
    threading.Thread(target=_async_ticker, args=(world,), daemon=True, name="standin-async").start()
    servers = []
    for port, handler in ((rpc_port, _RpcHandler), (stream_port, _StreamHandler)):
        srv = _Server((host, port), handler)
        srv.world = world  # type: ignore[attr-defined]
        srv.handlers = make_handlers(world, version)  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, daemon=True, name=f"standin-{port}").start()
        servers.append(srv)
    return servers[0], servers[1]


def _watch_parent(parent: int, stop: threading.Event) -> None:
    """Set ``stop`` when this process is re-parented, i.e. the process that started it is gone."""
    while not stop.wait(PARENT_POLL_S):
        if os.getppid() != parent:
            log.warning("parent process %d is gone: stopping", parent)
            stop.set()


def _normalise_carla_flags(argv: list[str]) -> list[str]:
    """Map ``CarlaUE4.sh`` flags onto ours and drop the ones that mean nothing here (-RenderOffScreen, ...)."""
    out = []
    for a in argv:
        if a.startswith("-carla-rpc-port="):
            out += ["--port", a.split("=", 1)[1]]
        elif a.startswith("-carla-streaming-port="):
            out += ["--streaming-port", a.split("=", 1)[1]]
        elif a.startswith("-") and not a.startswith("--"):
            continue
        else:
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python tests/support/carla_standin.py")
    p.add_argument("--port", type=int, default=2000, help="RPC port (CARLA's -carla-rpc-port)")
    p.add_argument("--streaming-port", type=int, default=None, help="streaming port (default: RPC port + 1)")
    p.add_argument("--map", required=True, help="OpenDRIVE file of the town loaded at start")
    p.add_argument("--maps-dir", default=None, help="folder of <Town>.xodr files load_world may switch to")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--verbose", action="store_true", help="log every RPC")
    p.add_argument("--report-version", default=VERSION, help="version string to report (tests of mismatch errors)")
    p.add_argument("--no-parent-watch", action="store_true",
                   help="keep serving when the parent process exits (default: exit with it)")
    args = p.parse_args(_normalise_carla_flags(list(sys.argv[1:] if argv is None else argv)))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(message)s")
    start = Path(args.map)
    if not start.is_file():
        p.error(f"--map {start}: no such OpenDRIVE file")
    maps = {start.stem: start}
    if args.maps_dir:
        maps.update({f.stem: f for f in sorted(Path(args.maps_dir).glob("*.xodr"))})
    stream_port = args.streaming_port or args.port + 1
    rpc, stream = serve(args.port, stream_port, maps, start.stem, args.host, args.report_version)
    log.info("stand-in CARLA %s serving %s on rpc %d / streaming %d (a test double, not a simulator)", VERSION,
             start.stem, args.port, stream_port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: stop.set())
    if not args.no_parent_watch:
        threading.Thread(target=_watch_parent, args=(os.getppid(), stop), daemon=True, name="standin-parent").start()
    stop.wait()
    rpc.shutdown()
    stream.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
