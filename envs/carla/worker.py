"""One environment on one CARLA server, through the real ``carla`` client: the simulator core with CARLA's parts.

The worker converts CARLA's world into the simulator's batched state (batch of one), so observations, infractions
and the reward are the built-in simulator's code (:class:`~envs.sim.env.SimEnv`). It owns the connection (client,
world, Traffic Manager, restarts) and assembles the core from parts (:mod:`envs.sim.parts`) that act through it:

* :class:`CarlaControl` (ego dynamics) -- ``carla.VehicleControl(throttle, steer, brake)`` from the action (our
  steer is positive to the left, CARLA's to the right, so the sign flips); CARLA's physics moves the ego;
* :class:`CarlaActors` (actors) -- spawns the ego at the route start, background vehicles on the Traffic Manager and
  pedestrians; per step one synchronous ``world.tick()`` of ``dt`` (``env.options.dt``, 0.1 s by default) and a read
  of ego pose/speed and all vehicles and walkers, of the vehicles' light states (one ``get_vehicles_light_states``
  RPC per tick) and of the traffic lights; the last reading is re-applied before each observation;
* :class:`CarlaLightSource` (lights) -- the colours of CARLA's traffic-light actors, matched to the map's light
  groups by their trigger volumes (:class:`CarlaLights`; see ``docs/carla.md``);
* :class:`CrashRecovery` (step hook) -- if the server dies or the client times out during a step, the episode is
  truncated (``info["carla/crash"]``), the server is restarted through :class:`envs.carla.servers.CarlaServer` (or,
  for an external server, waited for), a new client is created (old clients never reconnect), the restart is
  counted (``info["carla/restarts"]``) and the next episode starts. A failure while starting an episode is retried
  the same way.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from envs.carla.config import CarlaConfig
from envs.carla.mapping import (Reading, build_carla_world, ego_frame_velocity, fill_pedestrians, fill_vehicles,
                                graph_from_xodr, is_emergency, route_towns, vehicle_lights)
from envs.carla.servers import CLIENT_VERSION, CarlaServer, ServerError, probe_version
from envs.maps.opendrive import carla_to_world, world_to_carla, world_yaw_to_carla
from envs.sim.config import SimConfig
from envs.sim.env import SimEnv, SimState
from envs.sim.parts import ActorSource, EgoDynamics, LightCycle, SimTraffic, StepHook

log = logging.getLogger(__name__)

EGO_BLUEPRINT = "vehicle.lincoln.mkz_2020"  # CaRL's ego; half extent (2.45, 1.05) = SimConfig.ego_half_extent
LIGHT_MATCH_M = 15.0  # a stop line takes the CARLA light whose trigger volume centre is nearest, within this distance
CARLA_LIGHT_STATE = {0: 2, 1: 1, 2: 0}  # carla.TrafficLightState Red/Yellow/Green -> ours; Off/Unknown -> green


class CarlaError(RuntimeError):
    """A CARLA setup problem the worker cannot recover from (wrong town, version mismatch, restart budget spent)."""


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


class CarlaLightSource(LightCycle):
    """CARLA's traffic lights as the light source: the colours of the last read of ``carla`` (a :class:`CarlaLights`,
    set and read by whoever reads the CARLA world); the simulator's cycle model while there is none, with
    ``carla_lights`` off, or on a server without light actors."""

    def __init__(self, carla: CarlaLights | None = None):
        self.carla = carla

    def state(self, s: SimState, group: Tensor) -> tuple[Tensor, Tensor]:
        out = self.carla(group) if self.carla is not None else None
        return out if out is not None else super().state(s, group)


@dataclass
class _Tracked:
    """CARLA actors of the current episode and their bounding-box half extents (ours: length, width)."""

    ego: Any = None
    vehicles: list[Any] = field(default_factory=list)
    walkers: list[Any] = field(default_factory=list)
    controllers: list[Any] = field(default_factory=list)
    half: dict[int, tuple[float, float]] = field(default_factory=dict)
    emergency: dict[int, bool] = field(default_factory=dict)  # vehicles with special_type == "emergency"


def actor_half(actor: Any) -> tuple[float, float]:
    """Half extent (length, width) of a CARLA actor's bounding box."""
    e = actor.bounding_box.extent
    return float(e.x), float(e.y)


class CarlaControl(EgoDynamics):
    """CARLA's physics moves the ego: the action becomes the ego actor's ``carla.VehicleControl``; its pose comes back
    with the world's next tick (:class:`CarlaActors`)."""

    env: CarlaWorker

    def step(self, s: SimState, action: Tensor) -> None:
        env = self.env
        steer, throttle, brake = split_action(action[0])
        s.last_action = torch.tensor([[steer, throttle, brake]], device=env.device)
        if env.crashed:
            return
        try:
            env.actors.tracked.ego.apply_control(vehicle_control(env.carla, action[0]))
        except RuntimeError as e:
            env.mark_crash(e)


class CarlaActors(ActorSource):
    """The CARLA world mirrored into the state: spawns the ego where the episode starts, background vehicles on the
    Traffic Manager and walkers, and reads back after every tick (the ego's pose, speed and gear too: CARLA moves
    it)."""

    env: CarlaWorker

    def __init__(self):
        self.sim = SimTraffic()
        self.tracked = _Tracked()
        self.last: tuple[Reading, Reading] = (Reading.empty(), Reading.empty())

    def bind(self, env: CarlaWorker) -> None:
        super().bind(env)
        self.sim.bind(env)

    def reset(self, s: SimState, rows: Tensor) -> None:
        """A fresh episode on the server. The simulator's own draws come first: they give the padded actor tensors
        (CARLA's actors replace their contents) and keep the random stream the built-in simulator's (with
        ``carla_lights`` off and no CARLA traffic, an episode's light cycle is the simulator's)."""
        self.sim.reset(s, rows)
        s.statics.valid = torch.zeros_like(s.statics.valid)  # CARLA's parked cars are level geometry, not actors
        while True:
            try:
                self._start_episode(s)
                return
            except RuntimeError as e:  # a dead or hung server: the client only ever says "time-out"
                if isinstance(e, CarlaError):
                    raise
                self.env.recover(e)

    def step(self, s: SimState) -> None:
        env = self.env
        if env.crashed:
            return
        try:
            env.cworld.tick(env.ccfg.client_timeout)
            self.read(s)
        except RuntimeError as e:
            env.mark_crash(e)

    def refresh(self, s: SimState) -> None:
        """Re-apply the last reading: CARLA owns the actors (the rules may have dropped a hit actor from the state)."""
        self._apply_last(s)

    def forget(self) -> None:
        """Drop the actors of a server that is gone (a new client cannot reach them)."""
        self.tracked = _Tracked()

    def destroy(self) -> None:
        """Destroy the actors of the current episode (best effort: a dead server cannot)."""
        t = self.tracked
        for c in t.controllers:
            try:
                c.stop()
            except RuntimeError:
                pass
        for v in t.vehicles:  # unregister from the Traffic Manager first: it must never touch a destroyed actor
            try:
                v.set_autopilot(False, self.env.tm_port)
            except RuntimeError:
                pass
        for a in [*t.controllers, *t.walkers, *t.vehicles, *([t.ego] if t.ego is not None else [])]:
            try:
                a.destroy()
            except RuntimeError:
                pass
        self.tracked = _Tracked()

    def _transform(self, xy: np.ndarray, yaw: float, lift: float = 0.5) -> Any:
        carla = self.env.carla
        x, y = world_to_carla(float(xy[0]), float(xy[1]))
        wp = self.env.cmap.get_waypoint(carla.Location(x=x, y=y, z=0.0))
        z = (wp.transform.location.z if wp is not None else 0.0) + lift
        return carla.Transform(carla.Location(x=x, y=y, z=z), carla.Rotation(yaw=float(world_yaw_to_carla(yaw))))

    def _start_episode(self, s: SimState) -> None:
        env = self.env
        c, g, cworld = env.ccfg, env.gen, env.cworld
        self.destroy()
        t = self.tracked
        lib = cworld.get_blueprint_library()
        bp = lib.find(EGO_BLUEPRINT)
        bp.set_attribute("role_name", "hero")
        t.ego = cworld.spawn_actor(bp, self._transform(s.ego_xy[0].cpu().numpy(), float(s.ego_yaw[0])))
        t.half[t.ego.id] = actor_half(t.ego)
        ego = s.ego_xy[0].cpu().numpy()
        if c.traffic_vehicles > 0:
            vehicle_bps = [b for b in lib.filter("vehicle.*") if b.get_attribute("number_of_wheels").as_int() == 4]
            for tf in self._vehicle_spawns(ego, c.traffic_vehicles * 2)[: c.traffic_vehicles * 2]:
                if len(t.vehicles) >= c.traffic_vehicles:
                    break
                b = vehicle_bps[int(torch.randint(len(vehicle_bps), (1,), generator=g))]
                v = cworld.try_spawn_actor(b, tf)
                if v is not None:
                    v.set_autopilot(True, env.tm_port)
                    if c.vehicle_lights:  # brake lights and blinkers, as the leaderboard's background traffic
                        env.tm.update_vehicle_lights(v, True)
                    t.vehicles.append(v)
                    t.half[v.id] = actor_half(v)
                    t.emergency[v.id] = is_emergency(v)
        if c.traffic_pedestrians > 0:
            self._spawn_walkers(ego, c.traffic_pedestrians)
        cworld.tick()
        self.read(s)

    def _vehicle_spawns(self, ego: np.ndarray, n: int) -> list[Any]:
        """Spawn transforms at least 15 m from the ego: the map's recommended points, else random lane points."""
        env = self.env
        pts = list(env.cmap.get_spawn_points())
        if pts:
            order = torch.randperm(len(pts), generator=env.gen).tolist()
            return [pts[i] for i in order
                    if math.hypot(pts[i].location.x - ego[0], -pts[i].location.y - ego[1]) > 15.0][:n]
        from envs.sim.agents import lane_pose
        from envs.sim.world import sample_spawn

        lane, s = sample_spawn(env.world, (n,), env.gen, torch.zeros(n, dtype=torch.long, device=env.world.device))
        xy, yaw = lane_pose(env.world, lane, s)
        return [self._transform(p, float(a)) for p, a in zip(xy.cpu().numpy(), yaw.cpu().numpy())
                if np.linalg.norm(p - ego) > 15.0]

    def _spawn_walkers(self, ego: np.ndarray, n: int) -> None:
        """Walkers at crosswalks near the ego; CARLA's AI controllers walk them when ``walker_ai`` is set."""
        env, t, w = self.env, self.tracked, self.env.world
        if w.crosswalks.shape[0] == 0:
            return
        centres = w.crosswalks.mean(-2).cpu().numpy()
        near = np.argsort(np.linalg.norm(centres - ego, axis=-1))[:n]
        lib = env.cworld.get_blueprint_library()
        bps = list(lib.filter("walker.pedestrian.*"))
        for k, i in enumerate(near):
            b = bps[k % len(bps)]
            if b.has_attribute("is_invincible"):
                b.set_attribute("is_invincible", "false")
            walker = env.cworld.try_spawn_actor(b, self._transform(centres[i], 0.0, lift=1.0))
            if walker is None:
                continue
            t.walkers.append(walker)
            t.half[walker.id] = actor_half(walker)
            if env.ccfg.walker_ai:
                ctrl = env.cworld.spawn_actor(lib.find("controller.ai.walker"), env.carla.Transform(), walker)
                ctrl.start()
                ctrl.go_to_location(env.cworld.get_random_location_from_navigation())
                t.controllers.append(ctrl)

    def read(self, s: SimState) -> None:
        """Ego pose/speed and all tracked actors from the latest world snapshot (no RPC: the state stream), the
        vehicles' light states (one RPC for all of them; the snapshot does not carry them) and the traffic lights."""
        env = self.env
        snap = env.cworld.get_snapshot()
        t = self.tracked
        e = snap.find(t.ego.id)
        if e is None:
            raise RuntimeError("time-out: the ego is missing from the world snapshot")
        ego = Reading.from_carla(*self._arrays([e], [t.ego.id]))
        s.ego_xy = torch.as_tensor(ego.xy, device=env.device)
        s.ego_yaw = torch.as_tensor(ego.yaw, device=env.device)
        s.ego_speed = torch.as_tensor(ego.speed, device=env.device)
        vel, yaw = e.get_velocity(), e.get_transform().rotation.yaw
        s.ego_vel_local = torch.as_tensor(ego_frame_velocity(vel.x, vel.y, yaw), device=env.device).unsqueeze(0)
        s.gear = torch.tensor([float(t.ego.get_control().gear)], device=env.device)  # CARLA's gearbox (state stream)
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
                lights = vehicle_lights(env.cworld.get_vehicles_light_states(), ids,
                                        [t.emergency.get(i, False) for i in ids])
            readings.append(Reading.from_carla(*self._arrays([x for x, _ in snaps], ids), lights))
        self.last = (readings[0], readings[1])
        self._apply_last(s)
        if env.lights.carla is None:  # CARLA's lights -> light groups, once per connection (new actors, new client)
            env.lights.carla = CarlaLights(env.world, env.cworld, env.device, env.ccfg.carla_lights,
                                           f"CARLA port {env.port}")
        env.lights.carla.read()

    def _arrays(self, snaps: list[Any], ids: list[int]) -> tuple[np.ndarray, ...]:
        tf = [x.get_transform() for x in snaps]
        vel = [x.get_velocity() for x in snaps]
        return (np.array([a.location.x for a in tf]), np.array([a.location.y for a in tf]),
                np.array([a.rotation.yaw for a in tf]), np.array([v.x for v in vel]), np.array([v.y for v in vel]),
                np.array([self.tracked.half.get(i, (2.45, 1.05)) for i in ids]).reshape(-1, 2))

    def _apply_last(self, s: SimState) -> None:
        fill_vehicles(s.veh, self.last[0], s.ego_xy)
        fill_pedestrians(s.ped, self.last[1], s.ego_xy)


class CrashRecovery(StepHook):
    """A server that died or timed out during the step: its episode is truncated (with no termination reason), the
    server restarted and reconnected, and the next episode starts there; ``carla/crash`` and ``carla/restarts``
    report it every step (and per finished episode as ``episode/carla_crash``, ``episode/carla_restarts``)."""

    env: CarlaWorker

    def end_step(self, s: SimState, terminated: Tensor, truncated: Tensor, info: dict[str, Tensor]) -> Tensor:
        env = self.env
        crashed = env.crashed
        if crashed:
            env.recover(RuntimeError("server died or timed out during a step"))
            if not bool((terminated | truncated).any()):  # the step did not end the episode itself: truncate it here
                truncated = torch.ones_like(truncated)
                info["done"] = torch.ones_like(info["done"])
                for k in [k for k in info if k.startswith("episode/termination/")]:
                    info[k] = torch.zeros_like(info[k])
        info["carla/crash"] = torch.tensor([float(crashed)], device=env.device)
        info["carla/restarts"] = torch.tensor([float(env.restarts)], device=env.device)
        # per finished episode (the trainer logs every ``episode/*`` key): crashed episodes and restarts so far
        info["episode/carla_crash"] = info["carla/crash"].clone()
        info["episode/carla_restarts"] = info["carla/restarts"].clone()
        return truncated


class CarlaWorker(SimEnv):
    """CaRL's task on one CARLA server (``num_envs`` = 1). ``server`` is restarted on crashes when given."""

    actors: CarlaActors
    lights: CarlaLightSource

    def __init__(self, ccfg: CarlaConfig, scfg: SimConfig, port: int, tm_port: int, device: str | torch.device =
                 "cpu", seed: int = 0, server: CarlaServer | None = None):
        self.ccfg, self.port, self.tm_port, self.server = ccfg.validate(), port, tm_port, server
        self.restarts = 0
        self.carla = _carla()
        if scfg.route_file and ccfg.town not in route_towns(scfg.route_file):
            raise CarlaError(f"route file {scfg.route_file} has no routes for town {ccfg.town!r}; it uses "
                             f"{', '.join(route_towns(scfg.route_file))}")
        self._connect(scfg.dt, seed)
        xodr = self.cworld.get_map().to_opendrive()
        world = build_carla_world(graph_from_xodr(xodr, ccfg.town, scfg.cache_dir), ccfg.town, scfg,
                                  torch.device(device))
        super().__init__(scfg, 1, device, seed, world=world, ego=CarlaControl(), actors=CarlaActors(),
                         lights=CarlaLightSource(), hooks=(CrashRecovery(),))

    # ------------------------------------------------------------------ connection
    def _connect(self, dt: float, seed: int = 0) -> None:
        """A new client: version check, the town, synchronous mode at ``dt`` (the env's control step), the Traffic
        Manager."""
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
        settings.fixed_delta_seconds = dt  # one tick per control step (env.options.dt)
        settings.no_rendering_mode = c.no_rendering
        world.apply_settings(settings)
        self.cworld = world
        self.tm = None
        if c.traffic_vehicles > 0:
            self.tm = self.client.get_trafficmanager(self.tm_port)
            self.tm.set_synchronous_mode(True)
            self.tm.set_random_device_seed(seed)
        self.cmap = world.get_map()
        self.crashed = False

    def recover(self, why: BaseException) -> None:
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
        self._connect(self.cfg.dt, self.seed + self.restarts)
        self.actors.forget()
        self.lights.carla = None  # mapped again on the first read (new actors, new client)

    def mark_crash(self, e: BaseException) -> None:
        """A step's RPC failed: the rest of the step runs on the last reading, :class:`CrashRecovery` ends it."""
        log.warning("CARLA step failed on port %d: %s", self.port, e)
        self.crashed = True

    def close(self) -> None:
        """Destroy our actors and hand the server back in asynchronous mode (else it waits for ticks forever)."""
        try:
            self.actors.destroy()
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
