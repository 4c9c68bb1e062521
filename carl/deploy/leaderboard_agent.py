"""A Leaderboard 2.0 agent that drives an exported CaRL policy in the official evaluator (Track MAP).

The agent reads the world the evaluator runs (ego, vehicles, walkers, traffic lights, the map) through the CARLA
client, mirrors it into the built-in simulator's state with the env worker's conversion code
(:mod:`envs.carla.mapping`, :class:`envs.carla.lights.CarlaLights`), builds the observation with the simulator's own
code (``SimEnv.follow`` and ``SimEnv.observe``: the same tracking, BEV rasteriser and measurements as in training) and returns a
``carla.VehicleControl`` from the policy's action (:func:`envs.carla.worker.vehicle_control`).

Like CaRL's own agent it reads actors from the world (privileged, as the BEV was in training); it asks for no camera
or lidar, only the speedometer pseudo-sensor. The leaderboard runs at 20 Hz and the policy at 10 Hz (CaRL's control
period, the bundle's ``actions.control_period_s``): the agent acts every ``control_period`` seconds of simulation
time and repeats its control in between.

Run it with the official evaluator (``docs/carla.md``, "Leaderboard 2.0 evaluation")::

    python leaderboard/leaderboard_evaluator.py --agent=carl/deploy/leaderboard_agent.py \\
        --agent-config=<bundle dir | checkpoint .pt | agent .yaml/.json> --track=MAP --routes=... --checkpoint=...

``--agent-config`` is a policy (bundle directory or training checkpoint) or a YAML/JSON file
``{policy: <path>, device: cpu, options: {<SimConfig keys>}, carla_lights: true}``.

Only the leaderboard's base class needs the ``leaderboard`` package; everything else here works (and is tested)
without it, so the agent can be driven by any loop that ticks a CARLA world (see the tests).

It lives in :mod:`carl.deploy` because it joins the trainer's policy (:func:`carl.load_policy`) to the CARLA backend's
internals; ``envs`` never imports ``carl``.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from carl import zoo
from carl.bundle import load_policy
from envs.api import CONTROL_DT
from envs.carla.mapping import (Reading, ego_frame_velocity, fill_pedestrians, fill_vehicles, graph_from_xodr,
                                is_emergency, vehicle_lights)
from envs.carla.lights import CarlaLights, CarlaLightSource
from envs.carla.worker import split_action, vehicle_control
from envs.maps.opendrive import carla_to_world
from envs.maps.routes import plan_route
from envs.sim import infractions
from envs.config import from_dict
from envs.sim.config import SimConfig
from envs.sim.env import SimEnv
from envs.sim.world import build_world

log = logging.getLogger(__name__)

try:  # the official leaderboard (Leaderboard 2.0) on PYTHONPATH
    from leaderboard.autoagents.autonomous_agent import AutonomousAgent, Track

    HAVE_LEADERBOARD = True
except ImportError:  # tests and other loops: a minimal base with the same plan interface
    HAVE_LEADERBOARD = False
    Track = None

    class AutonomousAgent:  # type: ignore[no-redef]
        """The parts of ``leaderboard.autoagents.autonomous_agent.AutonomousAgent`` this agent uses."""

        def __init__(self, carla_host: str = "localhost", carla_port: int = 2000, debug: bool = False):
            self._global_plan = None
            self._global_plan_world_coord = None

        def set_global_plan(self, global_plan_gps: list, global_plan_world_coord: list) -> None:
            self._global_plan = global_plan_gps
            self._global_plan_world_coord = global_plan_world_coord


def get_entry_point() -> str:
    return "CarlAgent"


def keypoints_from_plan(plan: list) -> np.ndarray:
    """The leaderboard's global plan ``[(carla.Transform, RoadOption)]`` -> keypoints [K, 2] in OUR frame."""
    xs = np.array([float(t.location.x) for t, _ in plan])
    ys = np.array([float(t.location.y) for t, _ in plan])
    wx, wy = carla_to_world(xs, ys)
    return np.stack([wx, wy], -1)


def reading_from_actors(actors: list[Any], lights: np.ndarray | None = None) -> Reading:
    """Poses, speeds and bounding boxes of CARLA actors (client-side snapshot reads) as a :class:`Reading`;
    ``lights``: the vehicles' ``LIGHT_*`` bitmask (:func:`envs.carla.mapping.vehicle_lights`)."""
    if not actors:
        return Reading.empty()
    tf = [a.get_transform() for a in actors]
    vel = [a.get_velocity() for a in actors]
    half = np.array([(a.bounding_box.extent.x, a.bounding_box.extent.y) for a in actors], np.float64)
    return Reading.from_carla(np.array([t.location.x for t in tf]), np.array([t.location.y for t in tf]),
                              np.array([t.rotation.yaw for t in tf]), np.array([v.x for v in vel]),
                              np.array([v.y for v in vel]), half.reshape(-1, 2), lights)


def sim_config_for(spec: dict[str, Any], options: dict[str, Any] | None = None) -> SimConfig:
    """The simulator config a policy's observations need: the BEV geometry of its spec (or its vector observation's
    sizes), plus ``options``."""
    geo = spec.get("bev_geometry", {})
    opts = {k: geo[k] for k in ("bev_size", "bev_ppm", "bev_ego_from_bottom") if k in geo}
    if "vector_geometry" in spec:
        opts = {"observation": "vector", "bev": False, "vector": dict(spec["vector_geometry"])}
    opts.update(options or {})
    return from_dict(SimConfig, opts, "agent options").validate()


class CarlaMirror:
    """The simulator's state (batch of one) mirrored from a CARLA world someone else ticks.

    It owns no CARLA actors and never moves anything: :meth:`observe` reads the ego and the other actors into the
    state of a one-row simulator env (``self.env``: the map's world, CARLA's lights as its light source), lets the
    env's tracking stage follow them (time, route progress, stop lines, timers: as in a training step) and returns the
    env's observation. ``keypoints`` [K, 2] (our frame) are connected along the lane graph like the route files
    are."""

    def __init__(self, cworld: Any, keypoints: np.ndarray, cfg: SimConfig, device: str | torch.device = "cpu",
                 carla_lights: bool = True, town: str | None = None):
        town = town or cworld.get_map().name.rsplit("/", 1)[-1]
        graph = graph_from_xodr(cworld.get_map().to_opendrive(), town, cfg.cache_dir)
        route = plan_route(graph, np.asarray(keypoints, np.float64), name=f"{town}_leaderboard")
        self.device = torch.device(device)
        world = build_world(graph, [route], cfg, self.device)
        self.light_src = CarlaLights(world, cworld, self.device, carla_lights, "leaderboard agent")
        self.env = SimEnv(cfg, 1, self.device, 0, world=world, lights=CarlaLightSource(lambda: self.light_src))
        self.cworld = cworld
        self.state = self.env.state = self.env.initial_state(torch.arange(1, device=self.device))
        self.state.statics.valid = torch.zeros_like(self.state.statics.valid)  # level geometry in CARLA
        self._started = False

    def read(self, hero: Any) -> None:
        """Ego, vehicles and walkers of the current snapshot into the state (the worker's conversion)."""
        s, dev = self.state, self.device
        ego = reading_from_actors([hero])
        s.ego_xy = torch.as_tensor(ego.xy, device=dev)
        s.ego_yaw = torch.as_tensor(ego.yaw, device=dev)
        s.ego_speed = torch.as_tensor(ego.speed, device=dev)
        vel = hero.get_velocity()
        s.ego_vel_local = torch.as_tensor(ego_frame_velocity(vel.x, vel.y, hero.get_transform().rotation.yaw),
                                          device=dev).unsqueeze(0)
        s.gear = torch.tensor([float(hero.get_control().gear)], device=dev)
        actors = self.cworld.get_actors()
        vehicles = [a for a in actors.filter("vehicle.*") if a.id != hero.id]
        walkers = list(actors.filter("walker.pedestrian.*"))
        lights = None
        if vehicles:  # one RPC for every vehicle's light state
            lights = vehicle_lights(self.cworld.get_vehicles_light_states(), [a.id for a in vehicles],
                                    [is_emergency(a) for a in vehicles])
        fill_vehicles(s.veh, reading_from_actors(vehicles, lights), s.ego_xy)
        fill_pedestrians(s.ped, reading_from_actors(walkers), s.ego_xy)
        self.light_src.read()

    def observe(self, hero: Any, last_action: Tensor | None = None) -> dict[str, Tensor]:
        """The observation after the world moved on by ``cfg.dt`` (the first call: the episode's first one)."""
        s, w = self.state, self.env.world
        self.read(hero)
        if last_action is not None:
            s.last_action = torch.tensor([split_action(last_action)], device=self.device)
        if self._started:
            self.env.follow(s)
        else:  # the episode starts where the ego stands
            s.route_idx = infractions.route_progress(w, s.route_id, s.route_idx, s.ego_xy)
            s.hist_yaw = s.ego_yaw.unsqueeze(1).repeat(1, s.hist_yaw.shape[1])
            self._started = True
        return self.env.observe(s)


def read_agent_config(path: str | Path) -> dict[str, Any]:
    """``--agent-config``: a policy path (or ``zoo:<name>``), or a YAML/JSON file naming the policy and options."""
    if str(path).startswith(zoo.PREFIX):
        return {"policy": zoo.resolve(str(path))}
    p = Path(path)
    if p.is_dir() or p.suffix == ".pt":
        return {"policy": str(p)}
    if p.suffix in (".yaml", ".yml"):
        import yaml  # noqa: PLC0415

        conf = yaml.safe_load(p.read_text()) or {}
    elif p.suffix == ".json":
        conf = json.loads(p.read_text())
    else:
        raise ValueError(f"agent config {p}: give a bundle directory, a .pt checkpoint or a .yaml/.json file")
    if "policy" not in conf:
        raise ValueError(f"agent config {p}: needs a 'policy' entry (bundle directory or checkpoint)")
    pol = Path(zoo.resolve(str(conf["policy"])))
    conf["policy"] = str(pol if pol.is_absolute() else p.parent / pol)
    return conf


class CarlAgent(AutonomousAgent):
    """CaRL's policy as a Leaderboard 2.0 agent (Track MAP)."""


    def setup(self, path_to_conf_file: str, *_: Any, **__: Any) -> None:
        if HAVE_LEADERBOARD:
            self.track = Track.MAP
        conf = read_agent_config(path_to_conf_file)
        self.device = torch.device(conf.get("device", "cpu"))
        self.policy, self.spec = load_policy(conf["policy"], self.device, deterministic=True)
        # seconds between policy actions (the training env's step); controls repeat in between
        self.control_period = float(self.spec["actions"].get("control_period_s", CONTROL_DT))
        self.cfg = sim_config_for(self.spec, {"dt": self.control_period, **(conf.get("options") or {})})
        self.carla_lights = bool(conf.get("carla_lights", True))
        self.mirror: CarlaMirror | None = None
        self.hero: Any = None
        self.world: Any = getattr(self, "world", None)  # may be set by a caller without the leaderboard
        self._last_t: float | None = None
        self._action = torch.zeros(2)
        self._control: Any = None
        self.last_obs: dict[str, Tensor] | None = None

    def sensors(self) -> list[dict[str, Any]]:
        return [{"type": "sensor.speedometer", "reading_frequency": 20, "id": "speed"}]

    # ------------------------------------------------------------------ the world the evaluator runs
    def _carla_world(self) -> Any:
        if self.world is not None:
            return self.world
        from srunner.scenariomanager.carla_data_provider import CarlaDataProvider  # noqa: PLC0415

        self.world = CarlaDataProvider.get_world()
        return self.world

    def _find_hero(self) -> Any:
        if self.hero is not None:
            return self.hero
        for a in self._carla_world().get_actors().filter("vehicle.*"):
            if a.attributes.get("role_name") == "hero":
                self.hero = a
                return a
        raise RuntimeError("no vehicle with role_name 'hero' in the world: is the leaderboard running a route?")

    def _build_mirror(self) -> CarlaMirror:
        plan = self._global_plan_world_coord
        if not plan:
            raise RuntimeError("the agent has no global plan: the evaluator calls set_global_plan before run_step")
        return CarlaMirror(self._carla_world(), keypoints_from_plan(plan), self.cfg, self.device, self.carla_lights)

    # ------------------------------------------------------------------ one evaluator tick
    def run_step(self, input_data: dict, timestamp: float) -> Any:
        import carla  # noqa: PLC0415

        if self.mirror is None:
            self.mirror = self._build_mirror()
        due = self._last_t is None or timestamp - self._last_t >= self.control_period - 1e-6
        if due or self._control is None:
            obs = self.mirror.observe(self._find_hero(), None if self._last_t is None else self._action)
            with torch.no_grad():
                self._action = self.policy({k: v.to(self.device) for k, v in obs.items()})[0].float().cpu()
            if not bool(torch.isfinite(self._action).all()):
                self._action = torch.tensor([0.0, -1.0])  # never send NaN to CARLA: brake
            self._control = vehicle_control(carla, self._action)
            self._last_t = timestamp if self._last_t is None else self._last_t + self.control_period * max(
                1, math.floor((timestamp - self._last_t) / self.control_period + 1e-6))
            self.last_obs = obs
        return self._control

    def destroy(self) -> None:
        self.mirror = None
        self.hero = None
