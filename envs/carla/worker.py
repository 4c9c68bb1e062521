"""One environment on one CARLA server, through the real ``carla`` client: the simulator core with CARLA's parts.

The worker converts CARLA's world into the simulator's batched state (batch of one), so observations, infractions
and the reward are the built-in simulator's code (:class:`~envs.sim.env.SimEnv`). :func:`build_carla_env` opens a
:class:`CarlaSession` (client, world, Traffic Manager, crash state, restarts; also ``env.data``) and assembles the
core from parts (:mod:`envs.sim.parts`) that act through it:

* :class:`CarlaControl` (ego dynamics) -- ``carla.VehicleControl(throttle, steer, brake)`` from the action (our
  steer is positive to the left, CARLA's to the right, so the sign flips); CARLA's physics moves the ego;
* :class:`CarlaActors` (actors) -- spawns the ego at the route start, background vehicles on the Traffic Manager and
  pedestrians; per step one synchronous ``world.tick()`` of ``dt`` (``env.options.dt``, 0.1 s by default) and a read
  of ego pose/speed and all vehicles and walkers, of the vehicles' light states (one ``get_vehicles_light_states``
  RPC per tick) and of the traffic lights; the last reading is re-applied before each observation;
* :class:`CarlaLightSource` (lights) -- the colours of CARLA's traffic-light actors, matched to the map's light
  groups by their trigger volumes (:class:`CarlaLights`; see ``docs/carla.md``);
* crash recovery -- if the server dies or the client times out during a step, the session restarts the server
  through :class:`envs.carla.servers.CarlaServer` (or, for an external server, waits for it) and creates a new client
  (old clients never reconnect); the rules truncate the episode with no termination reason (their ``aborted``
  input) and :class:`CarlaCrashMetrics` reports it (``info["carla/crash"]``, ``info["carla/restarts"]``); the next
  episode starts on the new server. A failure while starting an episode is retried the same way.
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
from envs.carla.lights import CarlaLights, CarlaLightSource
from envs.carla.scenarios import CarlaScenarios
from envs.carla.mapping import (Reading, build_carla_world, ego_frame_velocity, fill_pedestrians, fill_vehicles,
                                graph_from_xodr, is_emergency, route_towns, vehicle_lights)
from envs.carla.servers import CLIENT_VERSION, CarlaError, CarlaServer, ServerError, probe_version
from envs.maps.opendrive import world_to_carla, world_yaw_to_carla
from envs.sim.config import SimConfig
from envs.sim.env import SimEnv
from envs.sim.parts import ActorSource, EgoDynamics, Metrics, SimTraffic
from envs.sim.rules import RULE_SETS
from envs.sim.state import Setup, SimState
from envs.sim.world import LightFn

log = logging.getLogger(__name__)

EGO_BLUEPRINT = "vehicle.lincoln.mkz_2020"  # CaRL's ego; its half extent is SimConfig.ego_half_extent


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
    with the world's next tick (:class:`CarlaActors`, whose ``tracked.ego`` it steers)."""

    def __init__(self, session: CarlaSession, actors: CarlaActors):
        self.session, self.actors = session, actors

    def step(self, s: SimState, action: Tensor) -> None:
        steer, throttle, brake = split_action(action[0])
        s.last_action = torch.tensor([[steer, throttle, brake]], device=self.setup.device)
        if self.session.crashed:
            return
        try:
            self.actors.tracked.ego.apply_control(vehicle_control(self.session.carla, action[0]))
        except RuntimeError as e:
            self.session.mark_crash(e)


class CarlaActors(ActorSource):
    """The CARLA world mirrored into the state: spawns the ego where the episode starts, background vehicles on the
    Traffic Manager and walkers, and reads back after every tick (the ego's pose, speed and gear too: CARLA moves
    it)."""

    def __init__(self, session: CarlaSession):
        self.session = session
        self.sim = SimTraffic()
        self.tracked = _Tracked()
        self.last: tuple[Reading, Reading] = (Reading.empty(), Reading.empty())

    def bind(self, setup: Setup) -> None:
        super().bind(setup)
        self.sim.bind(setup)

    def reset(self, s: SimState, rows: Tensor) -> None:
        """A fresh episode on the server. The simulator's own draws come first: they give the padded actor tensors
        (CARLA's actors replace their contents) and keep the random stream the built-in simulator's (with
        ``carla_lights`` off and no CARLA traffic, an episode's light cycle is the simulator's)."""
        self.sim.reset(s, rows)
        s.statics.valid = torch.zeros_like(s.statics.valid)  # CARLA's parked cars are level geometry, not actors
        self.session.lost = False
        while True:
            try:
                self._start_episode(s)
                return
            except RuntimeError as e:  # a dead or hung server: the client only ever says "time-out"
                if isinstance(e, CarlaError):
                    raise
                self.recover(e)

    def step(self, s: SimState, lights: LightFn) -> None:
        """One synchronous tick and a read; a server lost during the step (here or in :class:`CarlaControl`) is
        recovered at once and the episode counts as lost (the rest of the step runs on the last reading)."""
        sess = self.session
        if not sess.crashed:
            try:
                sess.cworld.tick(sess.ccfg.client_timeout)
                self.read(s)
            except RuntimeError as e:
                sess.mark_crash(e)
        if sess.crashed:
            sess.lost = True
            self.recover(RuntimeError("server died or timed out during a step"))

    def recover(self, why: BaseException) -> None:
        """A new server and client (:meth:`CarlaSession.recover`); the old actors are gone with the old server."""
        self.session.recover(why)
        self.forget()

    def close(self) -> None:
        """Destroy our actors, then close the session (the server back in asynchronous mode, or killed)."""
        try:
            self.destroy()
        finally:
            self.session.close()

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
                v.set_autopilot(False, self.session.tm_port)
            except RuntimeError:
                pass
        for a in [*t.controllers, *t.walkers, *t.vehicles, *([t.ego] if t.ego is not None else [])]:
            try:
                a.destroy()
            except RuntimeError:
                pass
        self.tracked = _Tracked()

    def _transform(self, xy: np.ndarray, yaw: float, lift: float = 0.5) -> Any:
        carla = self.session.carla
        x, y = world_to_carla(float(xy[0]), float(xy[1]))
        wp = self.session.cmap.get_waypoint(carla.Location(x=x, y=y, z=0.0))
        z = (wp.transform.location.z if wp is not None else 0.0) + lift
        return carla.Transform(carla.Location(x=x, y=y, z=z), carla.Rotation(yaw=float(world_yaw_to_carla(yaw))))

    def _start_episode(self, s: SimState) -> None:
        sess = self.session
        c, g, cworld = sess.ccfg, self.setup.gen, sess.cworld
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
                    v.set_autopilot(True, sess.tm_port)
                    if c.vehicle_lights:  # brake lights and blinkers, as the leaderboard's background traffic
                        sess.tm.update_vehicle_lights(v, True)
                    t.vehicles.append(v)
                    t.half[v.id] = actor_half(v)
                    t.emergency[v.id] = is_emergency(v)
        if c.traffic_pedestrians > 0:
            self._spawn_walkers(ego, c.traffic_pedestrians)
        cworld.tick()
        self.read(s)

    def _vehicle_spawns(self, ego: np.ndarray, n: int) -> list[Any]:
        """Spawn transforms at least 15 m from the ego: the map's recommended points, else random lane points."""
        st = self.setup
        pts = list(self.session.cmap.get_spawn_points())
        if pts:
            order = torch.randperm(len(pts), generator=st.gen).tolist()
            return [pts[i] for i in order
                    if math.hypot(pts[i].location.x - ego[0], -pts[i].location.y - ego[1]) > 15.0][:n]
        from envs.sim.agents import lane_pose
        from envs.sim.world import sample_spawn

        lane, s = sample_spawn(st.world, (n,), st.gen, torch.zeros(n, dtype=torch.long, device=st.world.device))
        xy, yaw = lane_pose(st.world, lane, s)
        return [self._transform(p, float(a)) for p, a in zip(xy.cpu().numpy(), yaw.cpu().numpy())
                if np.linalg.norm(p - ego) > 15.0]

    def _spawn_walkers(self, ego: np.ndarray, n: int) -> None:
        """Walkers at crosswalks near the ego; CARLA's AI controllers walk them when ``walker_ai`` is set."""
        sess, t, w = self.session, self.tracked, self.setup.world
        if w.crosswalks.shape[0] == 0:
            return
        centres = w.crosswalks.mean(-2).cpu().numpy()
        near = np.argsort(np.linalg.norm(centres - ego, axis=-1))[:n]
        lib = sess.cworld.get_blueprint_library()
        bps = list(lib.filter("walker.pedestrian.*"))
        for k, i in enumerate(near):
            b = bps[k % len(bps)]
            if b.has_attribute("is_invincible"):
                b.set_attribute("is_invincible", "false")
            walker = sess.cworld.try_spawn_actor(b, self._transform(centres[i], 0.0, lift=1.0))
            if walker is None:
                continue
            t.walkers.append(walker)
            t.half[walker.id] = actor_half(walker)
            if sess.ccfg.walker_ai:
                ctrl = sess.cworld.spawn_actor(lib.find("controller.ai.walker"), sess.carla.Transform(), walker)
                ctrl.start()
                ctrl.go_to_location(sess.cworld.get_random_location_from_navigation())
                t.controllers.append(ctrl)

    def read(self, s: SimState) -> None:
        """Ego pose/speed and all tracked actors from the latest world snapshot (no RPC: the state stream), the
        vehicles' light states (one RPC for all of them; the snapshot does not carry them) and the traffic lights."""
        sess, dev = self.session, self.setup.device
        snap = sess.cworld.get_snapshot()
        t = self.tracked
        e = snap.find(t.ego.id)
        if e is None:
            raise RuntimeError("time-out: the ego is missing from the world snapshot")
        ego = Reading.from_carla(*self._arrays([e], [t.ego.id]))
        s.ego_xy = torch.as_tensor(ego.xy, device=dev)
        s.ego_yaw = torch.as_tensor(ego.yaw, device=dev)
        s.ego_speed = torch.as_tensor(ego.speed, device=dev)
        vel, yaw = e.get_velocity(), e.get_transform().rotation.yaw
        s.ego_vel_local = torch.as_tensor(ego_frame_velocity(vel.x, vel.y, yaw), device=dev).unsqueeze(0)
        s.gear = torch.tensor([float(t.ego.get_control().gear)], device=dev)  # CARLA's gearbox (state stream)
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
                lights = vehicle_lights(sess.cworld.get_vehicles_light_states(), ids,
                                        [t.emergency.get(i, False) for i in ids])
            readings.append(Reading.from_carla(*self._arrays([x for x, _ in snaps], ids), lights))
        self.last = (readings[0], readings[1])
        self._apply_last(s)
        if sess.lights is None:  # CARLA's lights -> light groups, once per connection (new actors, new client)
            sess.lights = CarlaLights(self.setup.world, sess.cworld, dev, sess.ccfg.carla_lights,
                                      f"CARLA port {sess.port}")
        sess.lights.read()

    def _arrays(self, snaps: list[Any], ids: list[int]) -> tuple[np.ndarray, ...]:
        tf = [x.get_transform() for x in snaps]
        vel = [x.get_velocity() for x in snaps]
        return (np.array([a.location.x for a in tf]), np.array([a.location.y for a in tf]),
                np.array([a.rotation.yaw for a in tf]), np.array([v.x for v in vel]), np.array([v.y for v in vel]),
                np.array([self.tracked.half.get(i, self.setup.cfg.ego_half_extent) for i in ids]).reshape(-1, 2))

    def _apply_last(self, s: SimState) -> None:
        fill_vehicles(s.veh, self.last[0], s.ego_xy)
        fill_pedestrians(s.ped, self.last[1], s.ego_xy)


class CarlaCrashMetrics(Metrics):
    """``carla/crash`` (this step's episode was lost to the server) and ``carla/restarts`` every step, and per finished
    episode as ``episode/carla_crash``, ``episode/carla_restarts`` (the trainer logs every ``episode/*`` key)."""

    def __init__(self, session: CarlaSession):
        self.session = session

    def episode_info(self, s: SimState, done: Tensor, ending: Tensor, truncated: Tensor) -> dict[str, Tensor]:
        dev = self.setup.device
        crash = torch.tensor([float(self.session.lost)], device=dev)
        restarts = torch.tensor([float(self.session.restarts)], device=dev)
        return {"carla/crash": crash, "carla/restarts": restarts, "episode/carla_crash": crash.clone(),
                "episode/carla_restarts": restarts.clone()}


class CarlaSession:
    """The connection to one CARLA server: client, world, map, Traffic Manager, the light matching of this connection
    (``lights``), the crash state (``crashed``: the connection broke; ``lost``: the current episode was lost to it)
    and the restarts. ``server`` is restarted on crashes when given."""

    def __init__(self, ccfg: CarlaConfig, port: int, tm_port: int, dt: float, seed: int = 0,
                 server: CarlaServer | None = None):
        self.ccfg, self.port, self.tm_port, self.server = ccfg.validate(), port, tm_port, server
        self.dt, self.seed = dt, seed
        self.restarts = 0
        self.lost = False
        self.carla = _carla()
        self.connect(seed)

    # ------------------------------------------------------------------ connection
    def connect(self, seed: int) -> None:
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
        settings.fixed_delta_seconds = self.dt  # one tick per control step (env.options.dt)
        settings.no_rendering_mode = c.no_rendering
        world.apply_settings(settings)
        self.cworld = world
        self.tm = None
        if c.traffic_vehicles > 0:
            self.tm = self.client.get_trafficmanager(self.tm_port)
            self.tm.set_synchronous_mode(True)
            self.tm.set_random_device_seed(seed)
        self.cmap = world.get_map()
        self.lights: CarlaLights | None = None  # matched again on the first read (new actors, new client)
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
        self.connect(self.seed + self.restarts)

    def mark_crash(self, e: BaseException) -> None:
        """A step's RPC failed: the rest of the step runs on the last reading; the actors recover the server."""
        log.warning("CARLA step failed on port %d: %s", self.port, e)
        self.crashed = True

    def close(self) -> None:
        """Hand the server back in asynchronous mode (else it waits for ticks forever), or kill ours."""
        try:
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


def build_carla_env(ccfg: CarlaConfig, scfg: SimConfig, port: int, tm_port: int, device: str | torch.device = "cpu",
                    seed: int = 0, server: CarlaServer | None = None) -> SimEnv:
    """CaRL's task on one CARLA server (``num_envs`` = 1): the core with CARLA's parts; ``env.data`` is the
    :class:`CarlaSession`. ``server`` is restarted on crashes when given."""
    if scfg.route_file and ccfg.town not in route_towns(scfg.route_file):
        raise CarlaError(f"route file {scfg.route_file} has no routes for town {ccfg.town!r}; it uses "
                         f"{', '.join(route_towns(scfg.route_file))}")
    session = CarlaSession(ccfg, port, tm_port, scfg.dt, seed, server)
    try:
        xodr = session.cworld.get_map().to_opendrive()
        world = build_carla_world(graph_from_xodr(xodr, ccfg.town, scfg.cache_dir), ccfg.town, scfg,
                                  torch.device(device))
        actors = CarlaActors(session)
        rules = RULE_SETS[scfg.rules](aborted=lambda s: torch.tensor([session.lost], device=s.t.device))
        return SimEnv(scfg, 1, device, seed, world=world, ego=CarlaControl(session, actors), actors=actors,
                      lights=CarlaLightSource(lambda: session.lights), rules=rules, scenarios=CarlaScenarios(session),
                      metrics=(CarlaCrashMetrics(session),), data=session)
    except BaseException:
        session.close()
        raise
