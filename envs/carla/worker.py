"""One environment on one CARLA server, through the real ``carla`` client: a :class:`~envs.sim.env.SimEnv` subclass.

The worker converts CARLA's world into the simulator's batched state (batch of one), so observations, infractions
and the reward are the built-in simulator's code. It overrides only what moves the world:

* ``_initial_state`` -- spawn the ego at the route start, background vehicles on the Traffic Manager and
  pedestrians, tick once and read the actors back;
* ``_move_ego`` -- ``carla.VehicleControl(throttle, steer, brake)`` from the action (our steer is positive to the
  left, CARLA's to the right, so the sign flips);
* ``_move_actors`` -- one synchronous ``world.tick()`` (``dt`` = 0.1 s) and a read of ego pose/speed and all
  vehicles and walkers, and of the vehicles' light states (one ``get_vehicles_light_states`` RPC per tick);
* ``_observe`` -- re-applies the last CARLA reading first (the simulator's periodic respawn of far vehicles would
  otherwise move actors that CARLA owns).

Crash handling: if the server dies or the client times out during a step, the episode is truncated
(``info["carla/crash"]``), the server is restarted through :class:`envs.carla.servers.CarlaServer` (or, for an
external server, waited for), a new client is created (old clients never reconnect), the restart is counted
(``info["carla/restarts"]``) and the next episode starts. A failure while starting an episode is retried the same
way. Traffic lights: ``_lights`` reports the colours of CARLA's traffic-light actors, matched to the map's light groups
by their trigger volumes (``carla_lights``; see ``docs/carla.md``).
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from envs.api import StepResult
from envs.carla.mapping import (Reading, build_carla_world, ego_frame_velocity, fill_pedestrians, fill_vehicles,
                                graph_from_xodr, is_emergency, route_towns, vehicle_lights)
from envs.carla.servers import CLIENT_VERSION, CarlaServer, ServerError, probe_version
from envs.maps.opendrive import carla_to_world, world_to_carla, world_yaw_to_carla
from envs.sim.config import ConfigError, SimConfig, from_dict
from envs.sim.env import SimEnv, SimState

log = logging.getLogger(__name__)

EGO_BLUEPRINT = "vehicle.lincoln.mkz_2020"  # CaRL's ego; half extent (2.45, 1.05) = SimConfig.ego_half_extent
LIGHT_MATCH_M = 15.0  # a stop line takes the CARLA light whose trigger volume centre is nearest, within this distance
CARLA_LIGHT_STATE = {0: 2, 1: 1, 2: 0}  # carla.TrafficLightState Red/Yellow/Green -> ours; Off/Unknown -> green


def _all_rows(device: torch.device) -> tuple[Tensor, ...]:
    """Arguments for ``SimEnv._initial_state`` selecting the worker's single row (the hook takes rows, or nothing
    in older versions of the simulator)."""
    takes_rows = len(inspect.signature(SimEnv._initial_state).parameters) > 1
    return (torch.arange(1, device=device),) if takes_rows else ()


class CarlaError(RuntimeError):
    """A CARLA setup problem the worker cannot recover from (wrong town, version mismatch, restart budget spent)."""


@dataclass
class CarlaConfig:
    """CARLA-specific options of ``env=carla`` (the remaining options configure the shared :class:`SimConfig`)."""

    town: str = "Town01"
    host: str = "127.0.0.1"
    base_port: int = 2000  # first RPC port; server i uses the i-th free block of 4 ports (rpc, stream, primary, TM)
    port_stride: int = 4
    launch: bool = True  # start and restart servers ourselves; false = connect to servers already running
    executable: str | None = None  # CarlaUE4.sh; default $CARLA_ROOT/CarlaUE4.sh
    extra_args: tuple[str, ...] = ()
    gpus: tuple[int, ...] = ()  # Vulkan adapter indices, assigned round-robin; () = let CARLA choose
    no_rendering: bool = True  # -nullrhi: BEV training needs no rendering
    traffic_vehicles: int = 20  # background vehicles spawned on the Traffic Manager
    traffic_pedestrians: int = 10
    walker_ai: bool = True  # walkers driven by CARLA's AI controllers (needs the server's navigation mesh)
    client_timeout: float = 10.0  # seconds a client call (tick) may take before the server counts as dead
    ready_timeout: float = 180.0  # seconds a (re)started server has to answer
    max_restarts: int = 1000  # per worker
    check_version: bool = True
    log_dir: str = "carla_logs"
    start_method: str = "spawn"  # multiprocessing start method of the worker processes
    carla_lights: bool = True  # light states from CARLA's traffic-light actors; false = the simulator's light cycle
    vehicle_lights: bool = True  # the Traffic Manager drives background vehicles' brake lights and blinkers

    def validate(self) -> "CarlaConfig":
        def need(cond: bool, key: str, fix: str) -> None:
            if not cond:
                raise ConfigError(f"env.options.{key}={getattr(self, key)!r}: {fix}")

        need(bool(self.town), "town", "name a CARLA town such as Town01")
        need(1024 <= self.base_port <= 65000, "base_port", "must be in [1024, 65000]")
        need(self.port_stride >= 4, "port_stride", "must be >= 4 (rpc, streaming, primary, traffic manager)")
        need(self.traffic_vehicles >= 0 and self.traffic_pedestrians >= 0, "traffic_vehicles", "counts must be >= 0")
        need(self.client_timeout > 0, "client_timeout", "must be > 0 seconds")
        need(self.ready_timeout > 0, "ready_timeout", "must be > 0 seconds")
        need(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        need(self.start_method in ("spawn", "forkserver", "fork"), "start_method", "use spawn, forkserver or fork")
        return self


def split_options(options: dict[str, Any]) -> tuple[CarlaConfig, SimConfig]:
    """Split ``env.options`` into CARLA options and simulator options; unknown keys name both sets of valid keys."""
    names = {f.name for f in dataclasses.fields(CarlaConfig)}
    carla_opts = {k: v for k, v in options.items() if k in names}
    sim_opts = {k: v for k, v in options.items() if k not in names}
    try:
        ccfg = from_dict(CarlaConfig, carla_opts, "env.options").validate()
        sim_opts.setdefault("map", ccfg.town)
        scfg = from_dict(SimConfig, sim_opts, "env.options")
    except ConfigError as e:
        if "unknown key" not in str(e):
            raise
        sim_names = {f.name for f in dataclasses.fields(SimConfig)}
        raise ConfigError(f"{e.args[0].split(':')[0]}: unknown key; CARLA keys: {', '.join(sorted(names))}; "
                          f"simulator keys: {', '.join(sorted(sim_names))}") from e
    if scfg.map != ccfg.town:
        raise ConfigError(f"env.options.map={scfg.map!r} differs from town={ccfg.town!r}; set only town")
    return ccfg, scfg.validate()


def _carla() -> Any:
    try:
        import carla  # noqa: PLC0415 - optional dependency
    except ImportError as e:  # pragma: no cover - depends on the install
        raise CarlaError(f"the CARLA backend needs the client: pip install carla=={CLIENT_VERSION}") from e
    return carla


def split_action(action: Tensor | np.ndarray) -> tuple[float, float, float]:
    """A policy action (steer, longitudinal) in [-1, 1] -> (steer ours, throttle, brake): the simulator's split."""
    steer, lon = float(action[0]), float(action[1])
    return steer, max(lon, 0.0), max(-lon, 0.0)


def vehicle_control(carla: Any, action: Tensor | np.ndarray) -> Any:
    """``carla.VehicleControl`` for a policy action; CARLA steers right for positive values, we steer left."""
    steer, throttle, brake = split_action(action)
    return carla.VehicleControl(throttle=throttle, steer=-steer, brake=brake)


class CarlaLights:
    """CARLA's traffic-light actors -> the map's light groups, and their colours each tick.

    Each signalised stop line of ``world`` takes the light whose trigger-volume centre is nearest (within
    :data:`LIGHT_MATCH_M`); a group takes the light most of its stop lines chose. Lights are static, so the matching
    runs once per connection. Colours are read from the client's latest snapshot (no RPC). ``__call__(group)`` returns
    ``(state 0/1/2, yellow seconds left)`` for light groups [B, N], or None when no CARLA light is in use (the caller
    then falls back to the simulator's cycle); a group no light matched counts as green."""

    def __init__(self, world: Any, cworld: Any, device: torch.device, enabled: bool = True, where: str = "CARLA"):
        self.device = device
        num_groups = int(world.group_junction.shape[0])
        group_light = np.full(max(num_groups, 1), -1, np.int64)
        lights = list(cworld.get_actors().filter("traffic.traffic_light*")) if enabled else []
        if lights and num_groups:
            centres = []
            for tl in lights:
                loc = tl.get_transform().transform(tl.trigger_volume.location)
                centres.append(carla_to_world(loc.x, loc.y))
            centres = np.asarray(centres, np.float64).reshape(-1, 2)
            stop_xy, groups = world.stop_xy.cpu().numpy(), world.stop_group.cpu().numpy()
            d = np.linalg.norm(stop_xy[:, None] - centres[None], axis=-1)
            near, close = d.argmin(1), d.min(1) < LIGHT_MATCH_M
            for g in range(num_groups):
                votes = near[(groups == g) & close]
                if len(votes):
                    group_light[g] = np.bincount(votes).argmax()
        self.actors = lights
        self.group_light = torch.as_tensor(group_light, device=device)
        self.used = sorted(set(group_light[group_light >= 0].tolist()))
        self.state = torch.zeros(max(len(lights), 1), dtype=torch.long, device=device)
        self.yellow = torch.zeros(max(len(lights), 1), device=device)
        if enabled:
            log.info("%s: %d traffic lights, %d of %d light groups matched", where, len(lights),
                     int((group_light >= 0).sum()), num_groups)

    @property
    def matched(self) -> int:
        return int((self.group_light >= 0).sum()) if self.actors else 0

    def read(self) -> None:
        if not self.used:
            return
        state, yellow = self.state.clone(), self.yellow.clone()
        for i in self.used:
            tl = self.actors[i]
            code = int(tl.get_state())
            state[i] = CARLA_LIGHT_STATE.get(code, 0)
            yellow[i] = max(tl.get_yellow_time() - tl.get_elapsed_time(), 0.0) if code == 1 else 0.0
        self.state, self.yellow = state, yellow

    def __call__(self, group: Tensor) -> tuple[Tensor, Tensor] | None:
        if not self.actors:
            return None
        light = self.group_light[group.clamp(min=0)]
        have = (group >= 0) & (light >= 0)
        idx = light.clamp(min=0)
        state = torch.where(have, self.state[idx], torch.zeros_like(idx))
        yellow = torch.where(have, self.yellow[idx], torch.zeros_like(self.yellow[idx]))
        return state, yellow


@dataclass
class _Tracked:
    """CARLA actors of the current episode and their bounding-box half extents (ours: length, width)."""

    ego: Any = None
    vehicles: list[Any] = field(default_factory=list)
    walkers: list[Any] = field(default_factory=list)
    controllers: list[Any] = field(default_factory=list)
    half: dict[int, tuple[float, float]] = field(default_factory=dict)
    emergency: dict[int, bool] = field(default_factory=dict)  # vehicles with special_type == "emergency"


class CarlaWorker(SimEnv):
    """CaRL's task on one CARLA server (``num_envs`` = 1). ``server`` is restarted on crashes when given."""

    def __init__(self, ccfg: CarlaConfig, scfg: SimConfig, port: int, tm_port: int, device: str | torch.device =
                 "cpu", seed: int = 0, server: CarlaServer | None = None):
        self.ccfg, self.port, self.tm_port, self.server = ccfg.validate(), port, tm_port, server
        self.restarts = 0
        self._crashed = False
        self._tracked = _Tracked()
        self._last: tuple[Reading, Reading] = (Reading.empty(), Reading.empty())
        self._light_src: CarlaLights | None = None  # CARLA's lights -> light groups; built on the first read
        self.carla = _carla()
        if scfg.route_file and ccfg.town not in route_towns(scfg.route_file):
            raise CarlaError(f"route file {scfg.route_file} has no routes for town {ccfg.town!r}; it uses "
                             f"{', '.join(route_towns(scfg.route_file))}")
        self._connect(seed)
        xodr = self.cworld.get_map().to_opendrive()
        world = build_carla_world(graph_from_xodr(xodr, ccfg.town, scfg.cache_dir), ccfg.town, scfg,
                                  torch.device(device))
        super().__init__(scfg, 1, device, seed, world=world)

    # ------------------------------------------------------------------ connection
    def _connect(self, seed: int = 0) -> None:
        """A new client: version check, the town, synchronous mode at ``dt``, the Traffic Manager."""
        carla, c = self.carla, self.ccfg
        self.client = carla.Client(c.host, self.port)
        self.client.set_timeout(c.client_timeout)
        version = self.client.get_server_version()
        if c.check_version and version != self.client.get_client_version():
            raise CarlaError(f"CARLA server on port {self.port} is {version}, the client is "
                             f"{self.client.get_client_version()}: install matching versions (docs/carla.md)")
        world = self.client.get_world()
        if world.get_map().name.rsplit("/", 1)[-1] != c.town:
            towns = [m.rsplit("/", 1)[-1] for m in self.client.get_available_maps()]
            if c.town not in towns:
                raise CarlaError(f"CARLA server on port {self.port} has no town {c.town!r}; it offers "
                                 f"{', '.join(sorted(towns)) or '(none)'}")
            world = self.client.load_world(c.town)
        settings = world.get_settings()
        settings.synchronous_mode = True
        settings.fixed_delta_seconds = 0.1
        settings.no_rendering_mode = c.no_rendering
        world.apply_settings(settings)
        self.cworld = world
        self.tm = None
        if c.traffic_vehicles > 0:
            self.tm = self.client.get_trafficmanager(self.tm_port)
            self.tm.set_synchronous_mode(True)
            self.tm.set_random_device_seed(seed)
        self.cmap = world.get_map()
        self._tracked = _Tracked()
        self._light_src = None  # mapped again on the first read (new actors, new client)

    def _recover(self, why: BaseException) -> None:
        """Restart (or wait for) the server and reconnect with a new client; counts the restart."""
        self.restarts += 1
        if self.restarts > self.ccfg.max_restarts:
            raise CarlaError(f"CARLA server on port {self.port}: restart budget of {self.ccfg.max_restarts} spent; "
                             f"last failure: {why}") from why
        log.warning("CARLA server on port %d failed (%s); restart #%d", self.port, why, self.restarts)
        if self.server is not None:
            self.server.restart()
        else:
            deadline = time.monotonic() + self.ccfg.ready_timeout
            while probe_version(self.ccfg.host, self.port, 2.0) is None:
                if time.monotonic() > deadline:
                    raise ServerError(f"external CARLA server on port {self.port} did not come back within "
                                      f"{self.ccfg.ready_timeout:.0f} s after: {why}") from why
                time.sleep(1.0)
        self._connect(self.seed + self.restarts)

    # ------------------------------------------------------------------ episodes
    def _initial_state(self, *rows: Tensor) -> SimState:
        """A fresh episode (``rows`` is the simulator's optional row selection; the worker has one row)."""
        s = super()._initial_state(*rows)  # route choice, light offsets, reward state; actors are replaced below
        s.statics.valid = torch.zeros_like(s.statics.valid)  # CARLA's parked cars are level geometry, not actors
        while True:
            try:
                self._start_episode(s)
                return s
            except RuntimeError as e:  # a dead or hung server: the client only ever says "time-out"
                if isinstance(e, CarlaError):
                    raise
                self._recover(e)

    def _destroy_actors(self) -> None:
        t = self._tracked
        for c in t.controllers:
            try:
                c.stop()
            except RuntimeError:
                pass
        for v in t.vehicles:  # unregister from the Traffic Manager first: it must never touch a destroyed actor
            try:
                v.set_autopilot(False, self.tm_port)
            except RuntimeError:
                pass
        for a in [*t.controllers, *t.walkers, *t.vehicles, *([t.ego] if t.ego is not None else [])]:
            try:
                a.destroy()
            except RuntimeError:
                pass
        self._tracked = _Tracked()

    def _transform(self, xy: np.ndarray, yaw: float, lift: float = 0.5) -> Any:
        carla = self.carla
        x, y = world_to_carla(float(xy[0]), float(xy[1]))
        wp = self.cmap.get_waypoint(carla.Location(x=x, y=y, z=0.0))
        z = (wp.transform.location.z if wp is not None else 0.0) + lift
        return carla.Transform(carla.Location(x=x, y=y, z=z), carla.Rotation(yaw=float(world_yaw_to_carla(yaw))))

    def _start_episode(self, s: SimState) -> None:
        c, g = self.ccfg, self.gen
        self._destroy_actors()
        t = self._tracked
        lib = self.cworld.get_blueprint_library()
        bp = lib.find(EGO_BLUEPRINT)
        bp.set_attribute("role_name", "hero")
        t.ego = self.cworld.spawn_actor(bp, self._transform(s.ego_xy[0].cpu().numpy(), float(s.ego_yaw[0])))
        t.half[t.ego.id] = self._half(t.ego)
        ego = s.ego_xy[0].cpu().numpy()
        if c.traffic_vehicles > 0:
            vehicle_bps = [b for b in lib.filter("vehicle.*") if b.get_attribute("number_of_wheels").as_int() == 4]
            for tf in self._vehicle_spawns(ego, c.traffic_vehicles * 2)[: c.traffic_vehicles * 2]:
                if len(t.vehicles) >= c.traffic_vehicles:
                    break
                b = vehicle_bps[int(torch.randint(len(vehicle_bps), (1,), generator=g))]
                v = self.cworld.try_spawn_actor(b, tf)
                if v is not None:
                    v.set_autopilot(True, self.tm_port)
                    if c.vehicle_lights:  # brake lights and blinkers, as the leaderboard's background traffic
                        self.tm.update_vehicle_lights(v, True)
                    t.vehicles.append(v)
                    t.half[v.id] = self._half(v)
                    t.emergency[v.id] = is_emergency(v)
        if c.traffic_pedestrians > 0:
            self._spawn_walkers(ego, c.traffic_pedestrians)
        self.cworld.tick()
        self._read(s)

    def _vehicle_spawns(self, ego: np.ndarray, n: int) -> list[Any]:
        """Spawn transforms at least 15 m from the ego: the map's recommended points, else random lane points."""
        pts = list(self.cmap.get_spawn_points())
        if pts:
            order = torch.randperm(len(pts), generator=self.gen).tolist()
            return [pts[i] for i in order
                    if math.hypot(pts[i].location.x - ego[0], -pts[i].location.y - ego[1]) > 15.0][:n]
        from envs.sim.agents import lane_pose
        from envs.sim.world import sample_spawn

        lane, s = sample_spawn(self.world, (n,), self.gen, torch.zeros(n, dtype=torch.long, device=self.world.device))
        xy, yaw = lane_pose(self.world, lane, s)
        return [self._transform(p, float(a)) for p, a in zip(xy.cpu().numpy(), yaw.cpu().numpy())
                if np.linalg.norm(p - ego) > 15.0]

    def _spawn_walkers(self, ego: np.ndarray, n: int) -> None:
        """Walkers at crosswalks near the ego; CARLA's AI controllers walk them when ``walker_ai`` is set."""
        carla, t, w = self.carla, self._tracked, self.world
        if w.crosswalks.shape[0] == 0:
            return
        centres = w.crosswalks.mean(-2).cpu().numpy()
        near = np.argsort(np.linalg.norm(centres - ego, axis=-1))[:n]
        bps = list(self.cworld.get_blueprint_library().filter("walker.pedestrian.*"))
        for k, i in enumerate(near):
            b = bps[k % len(bps)]
            if b.has_attribute("is_invincible"):
                b.set_attribute("is_invincible", "false")
            walker = self.cworld.try_spawn_actor(b, self._transform(centres[i], 0.0, lift=1.0))
            if walker is None:
                continue
            t.walkers.append(walker)
            t.half[walker.id] = self._half(walker)
            if self.ccfg.walker_ai:
                ctrl = self.cworld.spawn_actor(self.cworld.get_blueprint_library().find("controller.ai.walker"),
                                               carla.Transform(), walker)
                ctrl.start()
                ctrl.go_to_location(self.cworld.get_random_location_from_navigation())
                t.controllers.append(ctrl)

    @staticmethod
    def _half(actor: Any) -> tuple[float, float]:
        e = actor.bounding_box.extent
        return float(e.x), float(e.y)

    # ------------------------------------------------------------------ reading CARLA's state
    def _read(self, s: SimState) -> None:
        """Ego pose/speed and all tracked actors from the latest world snapshot (no RPC: the state stream), and the
        vehicles' light states (one RPC for all of them; the snapshot does not carry them)."""
        snap = self.cworld.get_snapshot()
        t = self._tracked
        e = snap.find(t.ego.id)
        if e is None:
            raise RuntimeError("time-out: the ego is missing from the world snapshot")
        ego = Reading.from_carla(*self._arrays([e], [t.ego.id]))
        s.ego_xy = torch.as_tensor(ego.xy, device=self.device)
        s.ego_yaw = torch.as_tensor(ego.yaw, device=self.device)
        s.ego_speed = torch.as_tensor(ego.speed, device=self.device)
        vel, yaw = e.get_velocity(), e.get_transform().rotation.yaw
        s.ego_vel_local = torch.as_tensor(ego_frame_velocity(vel.x, vel.y, yaw), device=self.device).unsqueeze(0)
        s.gear = torch.tensor([float(t.ego.get_control().gear)], device=self.device)  # CARLA's gearbox (state stream)
        readings = []
        for group in (t.vehicles, t.walkers):
            snaps = [(snap.find(a.id), a.id) for a in group]
            snaps = [(x, i) for x, i in snaps if x is not None]
            if not snaps:
                readings.append(Reading.empty())
                continue
            ids = [i for _, i in snaps]
            lights = None
            if group is t.vehicles:
                lights = vehicle_lights(self.cworld.get_vehicles_light_states(), ids,
                                        [t.emergency.get(i, False) for i in ids])
            readings.append(Reading.from_carla(*self._arrays([x for x, _ in snaps], ids), lights))
        self._last = (readings[0], readings[1])
        self._apply_last(s)
        self._read_lights()

    def _read_lights(self) -> None:
        if self._light_src is None:
            self._light_src = CarlaLights(self.world, self.cworld, self.device, self.ccfg.carla_lights,
                                          f"CARLA port {self.port}")
        self._light_src.read()

    def _lights(self, s: SimState, group: Tensor) -> tuple[Tensor, Tensor]:
        """CARLA's light colours for light groups [B, N] (see :class:`CarlaLights`); the simulator's cycle model when
        ``carla_lights`` is off or the server has no light actors."""
        out = self._light_src(group) if self._light_src is not None else None
        return out if out is not None else super()._lights(s, group)

    def _arrays(self, snaps: list[Any], ids: list[int]) -> tuple[np.ndarray, ...]:
        tf = [x.get_transform() for x in snaps]
        vel = [x.get_velocity() for x in snaps]
        return (np.array([a.location.x for a in tf]), np.array([a.location.y for a in tf]),
                np.array([a.rotation.yaw for a in tf]), np.array([v.x for v in vel]), np.array([v.y for v in vel]),
                np.array([self._tracked.half.get(i, (2.45, 1.05)) for i in ids]).reshape(-1, 2))

    def _apply_last(self, s: SimState) -> None:
        fill_vehicles(s.veh, self._last[0], s.ego_xy)
        fill_pedestrians(s.ped, self._last[1], s.ego_xy)

    # ------------------------------------------------------------------ the SimEnv hooks
    def _move_ego(self, s: SimState, action: Tensor) -> None:
        steer, throttle, brake = split_action(action[0])
        s.last_action = torch.tensor([[steer, throttle, brake]], device=self.device)
        if self._crashed:
            return
        try:
            self._tracked.ego.apply_control(vehicle_control(self.carla, action[0]))
        except RuntimeError as e:
            self._mark_crash(e)

    def _move_actors(self, s: SimState) -> None:
        if self._crashed:
            return
        try:
            self.cworld.tick(self.ccfg.client_timeout)
            self._read(s)
        except RuntimeError as e:
            self._mark_crash(e)

    def _mark_crash(self, e: BaseException) -> None:
        log.warning("CARLA step failed on port %d: %s", self.port, e)
        self._crashed = True

    def _observe(self, s: SimState, speed_limit: Tensor | None = None) -> dict[str, Tensor]:
        self._apply_last(s)
        return super()._observe(s, speed_limit)

    def step(self, action: Tensor) -> StepResult:
        """The simulator's step; a crash during it truncates the episode, restarts the server and starts a new one."""
        res = super().step(action)
        crashed = self._crashed
        if crashed:
            self._recover(RuntimeError("server died or timed out during a step"))
            self._crashed = False
            done = res.terminated | res.truncated
            if not bool(done.any()):  # the step did not end the episode itself: truncate it here
                res.truncated = torch.ones_like(res.truncated)
                res.info["done"] = torch.ones_like(res.info["done"])
                for k in [k for k in res.info if k.startswith("episode/termination/")]:
                    res.info[k] = torch.zeros_like(res.info[k])
            self.state = self._initial_state(*_all_rows(self.device))
            self._advance_route_assignment(torch.ones(1, dtype=torch.bool, device=self.device))
            res.obs = self._observe(self.state)
        res.info["carla/crash"] = torch.tensor([float(crashed)], device=self.device)
        res.info["carla/restarts"] = torch.tensor([float(self.restarts)], device=self.device)
        # per finished episode (the trainer logs every ``episode/*`` key): crashed episodes and restarts so far
        res.info["episode/carla_crash"] = res.info["carla/crash"].clone()
        res.info["episode/carla_restarts"] = res.info["carla/restarts"].clone()
        return res

    def close(self) -> None:
        """Destroy our actors and hand the server back in asynchronous mode (else it waits for ticks forever)."""
        try:
            self._destroy_actors()
            settings = self.cworld.get_settings()
            settings.synchronous_mode = False
            settings.fixed_delta_seconds = None
            self.cworld.apply_settings(settings)
            if self.tm is not None:
                self.tm.set_synchronous_mode(False)
        except Exception:  # noqa: BLE001 - a dead server cannot be cleaned up; it is killed below
            pass
        finally:
            if self.server is not None:
                self.server.kill()
