"""A nuplan-devkit planner that drives with a CaRL policy, to run nuPlan's official simulation and metrics.

``CarlPlanner`` subclasses the devkit's ``AbstractPlanner`` when ``nuplan`` is importable (the devkit is optional:
it is not on the package registry and pins old libraries). Without it, importing this module still works and only
creating the planner raises an ImportError saying how to install the devkit. See docs/nuplan.md.

What it does per simulation step:

1. ``initialize``: the map patch around the route (our GeoPackage reader, ``maps_root``) is compiled into the
   built-in simulator's lane graph exactly as the scenario cache does it, with the route along the mission's
   roadblocks, and held by a one-row nuPlan env (:func:`~envs.nuplan.env.build_nuplan_env`; no agents of its own);
2. ``compute_planner_trajectory``: the devkit's ego state, tracked objects and traffic-light statuses are written
   into that env's state and the observation is built by the env's own (shared) observation part
   (:class:`ObservationBuilder`) in the layout the policy was trained with (the bundle's ``observation_layout``:
   CaRL's CARLA observation, :class:`~envs.sim.parts.CarlaObserver`, or CaRL's nuPlan one,
   :class:`~envs.nuplan.observation.NuplanObserver`);
3. the policy's actions (in the bundle's action order: CaRL's nuPlan variant gives acceleration first) drive
   nuPlan's kinematic bicycle model forward (:func:`rollout_trajectory`, the env's
   :func:`~envs.nuplan.dynamics.bicycle_step`) for the trajectory horizon; every ``replan_every`` steps the observation
   is re-built at the predicted pose with the agents moved at constant velocity; the poses become the devkit's
   ``InterpolatedTrajectory``.

The parts that do not need the devkit (:class:`ObservationBuilder`, :func:`rollout_trajectory`, :func:`route_path`)
are tested on the synthetic dataset.

It lives in :mod:`carl.deploy` because it joins the trainer's policy (:func:`carl.load_policy`) to the nuPlan
backend's internals; ``envs`` never imports ``carl``.
"""
from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from carl.bundle import action_names, load_policy, observation_layout
from envs.api import ACTIONS, LAYOUT_CARLA, LAYOUT_NUPLAN, LAYOUT_VECTOR, action_permutation
from envs.nuplan.cache import REAR_AXLE_TO_CENTRE, CachedScenario
from envs.nuplan.config import NuplanOptions
from envs.nuplan.dynamics import WHEELBASE, bicycle_step
from envs.nuplan.env import build_nuplan_env, grid_shifts
from envs.nuplan.logs import ScenarioLogs
from envs.nuplan.mapgraph import build_patch
from envs.nuplan.nuplan_map import NuplanMap, load_location
from envs.nuplan.dynamics import centre_kinematics
from envs.nuplan.observation import NuplanObserver
from envs.nuplan.reader import FRAME_S
from envs.sim.agents import Pedestrians, Statics, Vehicles
from envs.sim.infractions import route_progress
from envs.sim.observation import CarlaObserver
from envs.sim.parts import Observer
from envs.sim.vector_obs import VectorObserver

HORIZON_S, DT = 8.0, FRAME_S  # the devkit's default trajectory horizon; our simulation step (a log frame)
PATCH_RADIUS = 80.0  # m around the route path
LIGHT_STATUS = {"GREEN": 0, "YELLOW": 1, "RED": 2, "UNKNOWN": 3}
ROLLOUT_ACTIONS = ACTIONS  # the action order rollout_trajectory's ``act`` returns (bicycle_step's default order)
OBSERVERS: dict[str, Callable[[ScenarioLogs], Observer]] = {LAYOUT_CARLA: lambda logs: CarlaObserver(),
                                                            LAYOUT_NUPLAN: NuplanObserver,
                                                            LAYOUT_VECTOR: lambda logs: VectorObserver()}

ActionFn = Callable[[int, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


# ---------------------------------------------------------------------------------------------- devkit-free parts
def rollout_trajectory(rear: np.ndarray, yaw: float, speed: float, accel: float, steer: float, act: ActionFn,
                       steps: int = int(HORIZON_S / DT), dt: float = DT) -> np.ndarray:
    """Roll nuPlan's kinematic bicycle model forward with the policy's actions.

    ``act(k, rear [1,2], yaw [1], speed [1], accel [1], steer [1]) -> action [1, 2]`` is asked at every step k.
    Returns [steps + 1, 7]: time (s), rear-axle x, y, heading, speed, acceleration, tire steering angle; row 0 is
    the current state."""
    f = lambda v: torch.tensor([v], dtype=torch.float32)  # noqa: E731
    r = torch.as_tensor(np.asarray(rear, np.float32)).reshape(1, 2)
    y, v, a, d = f(yaw), f(speed), f(accel), f(steer)
    out = [(0.0, float(r[0, 0]), float(r[0, 1]), float(y), float(v), float(a), float(d))]
    for k in range(steps):
        action = torch.as_tensor(act(k, r, y, v, a, d), dtype=torch.float32).reshape(1, 2).clamp(-1.0, 1.0)
        r, y, v, a, d = bicycle_step(r, y, v, a, d, action, dt)
        out.append(((k + 1) * dt, float(r[0, 0]), float(r[0, 1]), float(y), float(v), float(a), float(d)))
    traj = np.array(out, np.float64)
    # heading unwrapped in float64 from the rear-axle path (the model wraps it to [-pi, pi))
    traj[:, 3] = np.unwrap(traj[:, 3])
    return traj


def route_path(m: NuplanMap, start: np.ndarray, roadblocks: list[str]) -> np.ndarray:
    """A path [N, 2] through the route roadblocks: from ``start`` (global), per roadblock the lane (or connector)
    whose baseline starts nearest to the path's end."""
    path = [np.asarray(start, np.float64).reshape(1, 2)]
    for rb in roadblocks:
        lanes = m.lanes_of_group(str(rb))
        if not lanes:
            continue
        end = path[-1][-1]
        best = min(lanes, key=lambda l: float(np.linalg.norm(l.baseline[0] - end)))
        if len(path) == 1:  # the first roadblock: from the ego's projection onward
            k = int(np.linalg.norm(best.baseline - end, axis=1).argmin())
            path.append(best.baseline[k:])
        else:
            path.append(best.baseline)
    return np.concatenate(path)


class ObservationBuilder:
    """CaRL's observation for devkit-style inputs, built with the env's own observation part on a one-row
    nuPlan env (:func:`~envs.nuplan.env.build_nuplan_env`) whose map patch covers the route. All poses are global (map frame); agents are [N, 7] arrays
    of x, y, heading, length, width, vx, vy (box centres).

    ``layout``: the observation the policy expects (``carla`` or ``nuplan``, a bundle's ``observation_layout``);
    ``action_names``: the order of the policy's action components (a bundle's ``action_names``), in which
    ``set_state`` takes the last action."""

    def __init__(self, m: NuplanMap, ego_rear: np.ndarray, ego_yaw: float, roadblocks: list[str],
                 sim: dict | None = None, cache_dir: str | None = None, radius: float = PATCH_RADIUS,
                 frames: int = 200, layout: str = LAYOUT_CARLA, action_names: tuple[str, ...] = ACTIONS) -> None:
        if layout not in OBSERVERS:
            raise ValueError(f"observation layout {layout!r}: this planner builds {sorted(OBSERVERS)}")
        centre = np.asarray(ego_rear, np.float64) + REAR_AXLE_TO_CENTRE * np.array([math.cos(ego_yaw),
                                                                                      math.sin(ego_yaw)])
        path = route_path(m, centre, [str(r) for r in roadblocks])
        origin = np.asarray(ego_rear, np.float64).copy()
        light_ids = {int(f) for f, l in m.lanes.items() if l.is_connector and str(f).isdigit()}
        patch = build_patch(m, path, origin, light_ids, [str(r) for r in roadblocks], radius=radius, name="devkit")
        ego = np.zeros((frames, 7), np.float32)
        ego[:, 2] = ego_yaw
        sc = CachedScenario(token="devkit", log_name="devkit", scenario_type="devkit", map_name=m.name,
                            origin=origin, graph=patch.graph, route=patch.route, ego=ego,
                            agents=np.zeros((frames, 1, 7), np.float32), agent_valid=np.zeros((frames, 1), bool),
                            agent_types=np.zeros(1, np.int64),
                            lights=np.full((frames, max(1, len(patch.light_connectors))), 3, np.int8))
        self.light_col = {int(c): k for k, c in enumerate(patch.light_connectors)}
        self.origin = origin
        self.shift = grid_shifts([sc.graph])[0]
        cache_dir = cache_dir or os.path.join(tempfile.gettempdir(), "carl_devkit_planner")
        opts = NuplanOptions(cache_dir=cache_dir, route_split="eval", sim=dict(sim or {})).validate()
        self.env = build_nuplan_env([sc], opts, 1, "cpu", 0)
        self.env.reset(seed=0)
        self.logs: ScenarioLogs = self.env.data  # this builder's own scenario: set_state writes its light statuses
        self.layout, self.action_names = layout, tuple(action_names)
        self.observer = OBSERVERS[layout](self.logs)
        self.observer.bind(self.env.setup)
        self.frames = frames

    def to_world(self, xy: np.ndarray) -> np.ndarray:
        return np.asarray(xy, np.float64) - self.origin + self.shift

    def set_state(self, ego_rear: np.ndarray, ego_yaw: float, speed: float, accel: float, steer: float,
                  last_action: np.ndarray, vehicles: np.ndarray, pedestrians: np.ndarray, statics: np.ndarray,
                  lights: dict[int, int], t: float, kinematics: dict[str, Any] | None = None) -> None:
        """Write the inputs into the env's state. ``last_action``: the policy's last action, in its order
        (``action_names``); ``kinematics``: the ego at its centre as :func:`~envs.nuplan.dynamics.centre_kinematics`
        gives it (``vel`` and ``acc`` (x, y) in the body frame, ``steer_rate``, ``yaw_rate``, ``yaw_acc``; the
        devkit's own values at the current step), default that of a car driving straight at ``speed``."""
        s, env = self.env.state, self.env
        f = lambda a: torch.as_tensor(np.asarray(a, np.float32))  # noqa: E731
        rear = f(self.to_world(ego_rear)).reshape(1, 2)
        yaw = f([ego_yaw])
        s.ego_xy = rear + REAR_AXLE_TO_CENTRE * torch.stack((torch.cos(yaw), torch.sin(yaw)), -1)
        s.ego_yaw, s.ego_speed, s.ego_accel, s.ego_steer = yaw, f([speed]), f([accel]), f([steer])
        k = kinematics or {"vel": (speed, 0.0), "acc": (accel, 0.0), "steer_rate": 0.0, "yaw_rate": 0.0,
                           "yaw_acc": 0.0}
        s.ego_vel_local, s.ego_acc_local = f([k["vel"]]), f([k["acc"]])
        s.ego_steer_rate, s.ego_yaw_rate, s.ego_yaw_acc = f([k["steer_rate"]]), f([k["yaw_rate"]]), f([k["yaw_acc"]])
        la = np.asarray(last_action, np.float32).reshape(-1)
        steer_cmd, lon = la[action_permutation(self.action_names, ACTIONS)]
        s.last_action = f([[steer_cmd, max(lon, 0.0), max(-lon, 0.0)]])  # the CARLA layout's measurements
        env_order = self.logs.action_names  # the nuPlan layout's: raw, in the env's order
        s.raw_action = f(la[action_permutation(self.action_names, env_order)]).reshape(1, 2)
        for name, default in (("progress", 0.0), ("comfort_score", 1.0), ("ttc_score", 1.0)):
            if getattr(s, name, None) is None:  # critic-only values: the actor never reads them
                setattr(s, name, f([default]))
        if getattr(s, "horizon", None) is None:
            s.horizon = torch.tensor([self.frames - 1])
        s.route_idx = route_progress(env.world, s.route_id, s.route_idx, s.ego_xy)
        s.t = f([t])

        def boxes(a: np.ndarray) -> tuple[Tensor, ...]:
            a = np.asarray(a, np.float32).reshape(-1, 7)
            if len(a) == 0:
                a = np.zeros((1, 7), np.float32)
                valid = torch.zeros(1, 1, dtype=torch.bool)
            else:
                valid = torch.ones(1, len(a), dtype=torch.bool)
            a = a.copy()
            a[:, :2] = self.to_world(a[:, :2])
            a = f(a)[None]
            return a, valid

        a, v = boxes(vehicles)
        z = torch.zeros_like(a[..., 0])
        s.veh = Vehicles(lane=z.long(), s=z.clone(), speed=a[..., 5:7].norm(dim=-1), next_lane=z.long(), valid=v,
                         half=a[..., 3:5] / 2, v_factor=torch.ones_like(z), stopped_at_sign=torch.zeros_like(v),
                         still_time=z.clone(), xy=a[..., :2].contiguous(), yaw=a[..., 2].contiguous(),
                        lights=torch.zeros_like(z, dtype=torch.int32))
        a, v = boxes(pedestrians)
        z = torch.zeros_like(a[..., 0])
        sp = a[..., 5:7].norm(dim=-1)
        s.ped = Pedestrians(crosswalk=z.long(), progress=z.clone(), direction=torch.ones_like(z), wait=z.clone(),
                            speed=sp, valid=v, xy=a[..., :2].contiguous(), yaw=a[..., 2].contiguous(), moving=sp > 0.2)
        a, v = boxes(statics)
        s.statics = Statics(xy=a[..., :2].contiguous(), yaw=a[..., 2].contiguous(), half=a[..., 3:5] / 2, valid=v)
        state = torch.full((self.logs.log_lights.shape[-1],), 3, dtype=torch.long)
        for lc, status in lights.items():
            if int(lc) in self.light_col:
                state[self.light_col[int(lc)]] = int(status)
        self.logs.log_lights[0, :] = state  # every frame: the observation reads the frame of s.steps
        zero = torch.zeros(1, dtype=torch.long)
        s.light_offset = self.logs.light_offsets(zero, zero, s.t, s.light_offset)

    def observe(self) -> dict[str, Tensor]:
        """The observation of the state written by :meth:`set_state`, in the policy's layout."""
        s = self.env.state
        return self.observer.observe(s, self.env.light_lookup(s))


def propagate(agents: np.ndarray, dt: float) -> np.ndarray:
    """Agents [N, 7] moved ``dt`` seconds at constant velocity."""
    a = np.asarray(agents, np.float64).reshape(-1, 7).copy()
    a[:, :2] += a[:, 5:7] * dt
    return a


def plan(builder: ObservationBuilder, policy: Callable[[dict[str, Tensor]], Tensor], ego: dict[str, Any],
         vehicles: np.ndarray, pedestrians: np.ndarray, statics: np.ndarray, lights: dict[int, int], t: float,
         last_action: np.ndarray, steps: int = int(HORIZON_S / DT), replan_every: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """The policy's trajectory from the current inputs: [steps + 1, 7] (see :func:`rollout_trajectory`) and the
    first action (in the policy's order, ``builder.action_names``; so is ``last_action``). ``ego``: rear (global
    [2]), yaw, speed, accel, steer, and optionally ``kinematics`` (the devkit's centre velocity, acceleration, steering
    rate, yaw rate and yaw acceleration: see :meth:`ObservationBuilder.set_state`)."""
    held = {"action": torch.as_tensor(np.asarray(last_action, np.float32)).reshape(1, 2), "first": None}
    to_rollout = action_permutation(builder.action_names, ROLLOUT_ACTIONS)
    prev = {"steer": float(ego["steer"]), "yaw_rate": float(ego["speed"]) * math.tan(float(ego["steer"])) / WHEELBASE}

    def act(k: int, rear: Tensor, yaw: Tensor, speed: Tensor, accel: Tensor, steer: Tensor) -> Tensor:
        if k == 0 and ego.get("kinematics") is not None:
            kin = dict(ego["kinematics"])
        else:  # the model's own state, as the env derives it
            kin = centre_kinematics(float(speed), float(accel), float(steer), prev["steer"], prev["yaw_rate"], DT)
        prev["steer"], prev["yaw_rate"] = float(steer), float(speed) * math.tan(float(steer)) / WHEELBASE
        if k % max(1, replan_every) == 0:
            builder.set_state(rear[0].numpy().astype(np.float64) + builder.origin, float(yaw), float(speed),
                              float(accel), float(steer),
                              held["action"].numpy(), propagate(vehicles, k * DT), propagate(pedestrians, k * DT),
                              statics, lights, t + k * DT, kinematics=kin)
            with torch.no_grad():
                held["action"] = torch.as_tensor(policy(builder.observe())).reshape(1, 2).float().cpu()
            if held["first"] is None:
                held["first"] = held["action"].clone()
        return held["action"][:, to_rollout]

    # rolled out in the patch's local frame (float32 global map coordinates would lose centimetres)
    traj = rollout_trajectory(np.asarray(ego["rear"], np.float64) - builder.origin, ego["yaw"], ego["speed"],
                              ego["accel"], ego["steer"], act, steps)
    traj[:, 1:3] += builder.origin
    return traj, held["first"].numpy()[0]


# ---------------------------------------------------------------------------------------------- the devkit planner
try:  # the devkit is optional
    from nuplan.planning.simulation.planner.abstract_planner import AbstractPlanner as _Base

    NUPLAN_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installation
    _Base = object
    NUPLAN_AVAILABLE = False

DEVKIT_MISSING = ("carl.deploy.nuplan_planner.CarlPlanner needs nuplan-devkit (import name `nuplan`), which is not "
                  "on the package registry: git clone https://github.com/motional/nuplan-devkit && pip install -e "
                  "nuplan-devkit (use its own environment; see docs/nuplan.md)")


class CarlPlanner(_Base):  # type: ignore[misc, valid-type]
    """nuplan-devkit planner driven by a CaRL policy (bundle directory or ``.pt`` checkpoint, ``carl.load_policy``).

    ``maps_root``: the nuPlan maps folder (``NUPLAN_MAPS_ROOT`` by default); ``replan_every``: policy queries every
    N 0.1 s steps of the rolled-out trajectory; ``horizon_s``: trajectory length."""

    requires_scenario: bool = False

    def __init__(self, policy_path: str, maps_root: str | None = None, device: str = "cpu", horizon_s: float = HORIZON_S,
                 replan_every: int = 5, cache_dir: str | None = None) -> None:
        if not NUPLAN_AVAILABLE:
            raise ImportError(DEVKIT_MISSING)
        self.policy, self.spec = load_policy(policy_path, device=device, deterministic=True)
        self.layout, self.action_names = observation_layout(self.spec), action_names(self.spec)
        self.maps_root = maps_root or os.environ.get("NUPLAN_MAPS_ROOT")
        if not self.maps_root:
            raise ValueError("CarlPlanner: give maps_root= or set NUPLAN_MAPS_ROOT (the nuPlan maps folder)")
        self.steps = int(round(horizon_s / DT))
        self.replan_every = replan_every
        self.cache_dir = cache_dir
        self.builder: ObservationBuilder | None = None
        self.last_action = np.zeros(2, np.float32)
        self._init: Any = None

    def name(self) -> str:
        return "CarlPlanner"

    def observation_type(self) -> Any:
        from nuplan.planning.simulation.observation.observation_type import DetectionsTracks

        return DetectionsTracks

    def initialize(self, initialization: Any) -> None:
        self._init = initialization  # the map patch is built at the first step (it needs the ego pose)
        self.builder = None

    def _sim_overrides(self) -> dict:
        if "vector_geometry" in self.spec:
            return {"observation": "vector", "bev": False, "vector": dict(self.spec["vector_geometry"])}
        g = self.spec.get("bev_geometry", {})
        return {k: g[k] for k in ("bev_size", "bev_ppm", "bev_ego_from_bottom") if k in g}

    def compute_planner_trajectory(self, current_input: Any) -> Any:
        from nuplan.common.actor_state.ego_state import EgoState
        from nuplan.common.actor_state.state_representation import StateSE2, StateVector2D, TimePoint
        from nuplan.common.actor_state.tracked_objects_types import TrackedObjectType
        from nuplan.planning.simulation.trajectory.interpolated_trajectory import InterpolatedTrajectory

        ego_state, observation = current_input.history.current_state
        rear = np.array([ego_state.rear_axle.x, ego_state.rear_axle.y])
        yaw = float(ego_state.rear_axle.heading)
        if self.builder is None:
            m = load_location(self.maps_root, self._init.map_api.map_name)
            self.builder = ObservationBuilder(m, rear, yaw, list(self._init.route_roadblock_ids),
                                              sim=self._sim_overrides(), cache_dir=self.cache_dir,
                                              layout=self.layout, action_names=self.action_names)
            self.t0 = ego_state.time_point.time_s

        def boxes(types: list[Any]) -> np.ndarray:
            objs = observation.tracked_objects.get_tracked_objects_of_types(types)
            return np.array([[o.center.x, o.center.y, o.center.heading, o.box.length, o.box.width,
                              o.velocity.x if o.velocity is not None else 0.0,
                              o.velocity.y if o.velocity is not None else 0.0] for o in objs], np.float64).reshape(-1, 7)

        vehicles = boxes([TrackedObjectType.VEHICLE, TrackedObjectType.BICYCLE])
        peds = boxes([TrackedObjectType.PEDESTRIAN])
        statics = boxes([TrackedObjectType.CZONE_SIGN, TrackedObjectType.BARRIER, TrackedObjectType.TRAFFIC_CONE,
                         TrackedObjectType.GENERIC_OBJECT])
        lights = {int(d.lane_connector_id): LIGHT_STATUS.get(d.status.name, 3)
                  for d in (current_input.traffic_light_data or [])}
        dyn = ego_state.dynamic_car_state
        ego = {"rear": rear, "yaw": yaw, "speed": float(dyn.rear_axle_velocity_2d.x),
               "accel": float(dyn.rear_axle_acceleration_2d.x), "steer": float(ego_state.tire_steering_angle),
               "kinematics": {"vel": (float(dyn.center_velocity_2d.x), float(dyn.center_velocity_2d.y)),
                              "acc": (float(dyn.center_acceleration_2d.x), float(dyn.center_acceleration_2d.y)),
                              "steer_rate": float(dyn.tire_steering_rate), "yaw_rate": float(dyn.angular_velocity),
                              "yaw_acc": float(dyn.angular_acceleration)}}
        traj, first = plan(self.builder, self.policy, ego, vehicles, peds, statics, lights,
                           ego_state.time_point.time_s - self.t0, self.last_action, self.steps, self.replan_every)
        self.last_action = first
        t0_us = ego_state.time_point.time_us
        params = ego_state.car_footprint.vehicle_parameters
        states = [ego_state] + [
            EgoState.build_from_rear_axle(
                rear_axle_pose=StateSE2(float(x), float(y), float(h)),
                rear_axle_velocity_2d=StateVector2D(float(v), 0.0),
                rear_axle_acceleration_2d=StateVector2D(float(a), 0.0),
                tire_steering_angle=float(d), time_point=TimePoint(int(t0_us + round(t * 1e6))),
                vehicle_parameters=params, is_in_auto_mode=True)
            for t, x, y, h, v, a, d in traj[1:]]
        return InterpolatedTrajectory(states)
