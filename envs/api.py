"""The batched environment interface the trainer sees.

Every backend (built-in simulator, CARLA workers, nuPlan) implements :class:`BatchedEnv`: ``B`` environments
stepped in one call, tensors on one device, automatic reset of finished environments. The trainer never imports
a backend; it receives a ``BatchedEnv`` from :func:`envs.make_env`.

Conventions
-----------
* ``reset()`` returns the first observation of every environment.
* ``step(action)`` takes ``action`` of shape ``[B, 2]`` in ``[-1, 1]`` (values outside are clipped, NaN raises)
  and returns a :class:`StepResult`. ``action_spec.names`` names the components: (steer, longitudinal) unless the
  backend says otherwise (CaRL's nuPlan order: accel, steer). Where ``terminated | truncated`` is true, the returned
  observation is already the first observation of the next episode (auto-reset), and ``info`` carries the finished
  episode's statistics under ``"episode/..."`` keys (valid only on those rows). If the env was built with
  ``keep_final_obs=True`` the terminal observation is in ``info["final_obs/<key>"]``. :data:`INFO_KEYS` documents
  the keys; :func:`episode_stats` and :func:`final_obs` read them.
* ``control_dt`` is the simulated time of one step; ``max_episode_steps``, where an env has it, is a step count by
  which every episode has ended by its rules.

This module is the interface only: it imports no implementation.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch import Tensor

CONTROL_DT = 0.1  # s: CaRL's control step (10 Hz), every backend's default ``dt``
COMFORT_METRICS = ("lon_acc", "lat_acc", "jerk", "lon_jerk", "yaw_rate", "yaw_acc")  # nuPlan's six comfort checks


@dataclass(frozen=True)
class TensorSpec:
    """Shape (without the batch dimension), dtype and bounds of one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    low: float = float("-inf")
    high: float = float("inf")
    names: tuple[str, ...] = ()  # what each index of the first dimension holds (BEV channels, measurement fields,
    # action components), or of the last one for an entity set [count, features]; () = unnamed


@dataclass
class StepResult:
    obs: dict[str, torch.Tensor]  # key -> [B, *spec.shape]
    reward: torch.Tensor  # [B] float32
    terminated: torch.Tensor  # [B] bool: an episode end the value must not bootstrap through
    truncated: torch.Tensor  # [B] bool: a time/route limit end
    info: dict[str, torch.Tensor]  # key -> [B, ...]


# Keys of the observation dict (CaRL's names).
OBS_BEV = "bev"  # uint8 [C, H, W]
OBS_MEASUREMENTS = "measurements"  # float32 [M], actor and critic (8 in the CARLA layout, 10 in the nuPlan one)
OBS_VALUE_MEASUREMENTS = "value_measurements"  # float32 [V], critic only (10 CARLA, 4 nuPlan)

# The observation layouts, each defined once: what the observation holds, in order. The CARLA layout (CaRL's CARLA
# observation, carl-reference.md §2) is every backend's default (envs/sim/observation.py); the nuPlan layout (CaRL's
# nuPlan observation, §17) is envs/nuplan/observation.py's.
LAYOUT_CARLA, LAYOUT_NUPLAN = "carla", "nuplan"
BEV_CHANNELS = ("road", "route", "lane_markings", "vehicles", "pedestrians", "traffic_lights", "stop_sign",
                "speed_signs", "static_objects", "shoulder")
MEASUREMENTS = ("last_steer", "last_throttle", "last_brake", "gear", "speed_x_mps", "speed_y_mps",
                "forward_speed_mps", "speed_limit_mps")
# fractions left of: the episode's time, the time until blocked, the route (points / 100), the TTC penalty window and
# each comfort penalty window
VALUE_MEASUREMENTS = ("time_left", "time_until_blocked", "route_points_left", "ttc_window_left",
                      *(f"comfort_window_left_{m}" for m in COMFORT_METRICS))
# CaRL's nuPlan observation (§17): 9 channels, 10 measurements (the last action in CaRL's nuPlan order, then the ego
# state at the vehicle centre in the body frame, x forward / y left), 4 critic values (all 1.0 at reset)
NUPLAN_BEV_CHANNELS = ("drivable_area", "route", "lane_boundaries", "traffic_lights", "stop_lines", "speed_limit",
                       "vehicles", "pedestrians_and_statics", "ego")
NUPLAN_MEASUREMENTS = ("last_acceleration", "last_steering", "velocity_x_mps", "velocity_y_mps",
                       "acceleration_x_mps2", "acceleration_y_mps2", "tire_steering_angle_rad",
                       "steering_rate_radps", "yaw_rate_radps", "yaw_acceleration_radps2")
NUPLAN_VALUE_MEASUREMENTS = ("time_left", "progress_left", "comfort_score", "ttc_score")

# The vector observation (env.options.observation=vector, envs/sim/vector_obs.py; a set-encoder policy, model.name=set):
# CaRL's measurements and value measurements, and one padded set per entity type, float32 [count, features], in the
# ego frame (x forward, y left, m; yaw relative to the ego's), nearest first, whose last feature is the validity flag
# (padding rows are all zero). Counts and radii: env.options.vector. Units are in the names (_m, _mps, _s).
LAYOUT_VECTOR = "vector"
OBS_ROUTE, OBS_LANES, OBS_VEHICLES = "route", "lanes", "vehicles"
OBS_PEDESTRIANS, OBS_STATICS, OBS_STOPS = "pedestrians", "statics", "stops"
VECTOR_FEATURES = {
    # the route ahead, every vector.route_spacing m from the ego's route point: junction 1 inside a junction;
    # lane_change +1 / -1 where the route changes to the lane on its left / right since the previous point
    OBS_ROUTE: ("x_m", "y_m", "cos_yaw", "sin_yaw", "junction", "lane_change", "speed_limit_mps", "valid"),
    # lane-centre points every vector.lane_spacing m within vector.lane_radius: the lane's direction there, width,
    # speed limit, whether it is a junction lane, whether its right edge is the kerb (no same-direction lane there)
    OBS_LANES: ("x_m", "y_m", "cos_yaw", "sin_yaw", "width_m", "speed_limit_mps", "junction", "kerb_right", "valid"),
    # actors: pose, velocity and size in the ego frame, and where they are relative to the route ahead: route_s_m
    # metres along it from the ego's route point (negative: behind) and route_d_m to its left (negative: right)
    OBS_VEHICLES: ("x_m", "y_m", "cos_yaw", "sin_yaw", "vx_mps", "vy_mps", "half_length_m", "half_width_m",
                   "brake_light", "emergency", "route_s_m", "route_d_m", "valid"),
    OBS_PEDESTRIANS: ("x_m", "y_m", "cos_yaw", "sin_yaw", "vx_mps", "vy_mps", "route_s_m", "route_d_m", "valid"),
    OBS_STATICS: ("x_m", "y_m", "cos_yaw", "sin_yaw", "half_length_m", "half_width_m", "route_s_m", "route_d_m",
                  "valid"),
    # the next stop lines on the route (route metres ahead, the line's centre): the light's colour one-hot (all 0 for
    # a stop sign), seconds of yellow left, a stop sign, and whether the ego has already stopped at that sign
    OBS_STOPS: ("ahead_m", "x_m", "y_m", "green", "yellow", "red", "yellow_left_s", "stop_sign", "sign_obeyed",
                "valid"),
}
VECTOR_SETS = tuple(VECTOR_FEATURES)  # the entity sets, in the observation's order
# With vector.path_conflicts, the moving actors (vehicles, pedestrians) also say where their constant-velocity path
# first meets the route ahead (within PATH_MEET_M of a route sample, in the next PATH_HORIZON_S): path_s_m route metres
# from the ego's route point, path_t_s seconds until then (PATH_HORIZON_S and path_s_m 0 where it does not meet), and
# path_meets 1/0. A car behind the ego on its route meets it at path_s_m 0 after path_t_s = gap / speed; a car of a
# crossing stream where it crosses or joins the route: the gap-acceptance quantities, read without a search
PATH_FEATURES = ("path_s_m", "path_t_s", "path_meets")
PATH_SETS = (OBS_VEHICLES, OBS_PEDESTRIANS)
PATH_MEET_M, PATH_HORIZON_S = 3.0, 10.0


def vector_features(path_conflicts: bool = False) -> dict[str, tuple[str, ...]]:
    """The feature names of each vector set (:data:`VECTOR_FEATURES`), with :data:`PATH_FEATURES` before the
    validity flag of the moving actors' sets where ``path_conflicts``."""
    if not path_conflicts:
        return dict(VECTOR_FEATURES)
    return {k: (*v[:-1], *PATH_FEATURES, v[-1]) if k in PATH_SETS else v for k, v in VECTOR_FEATURES.items()}

# Action components, in the order of the action tensor (``BatchedEnv.action_spec.names``).
ACTIONS = ("steer", "longitudinal")  # every backend's default: steer, throttle (> 0) / brake (< 0)
NUPLAN_ACTIONS = ("accel", "steer")  # CaRL's nuPlan order (§16.1; env.options.action_order of env=nuplan)
# How CaRL's nuPlan action is scaled (§16.2; envs/nuplan/dynamics.py applies it): accel a >= 0 -> a * 2.4 m/s^2,
# a < 0 -> a * 3.2 m/s^2 (the target acceleration); steer -> target tire angle a * 0.83775804 rad (48 deg, positive
# to the left)
NUPLAN_ACTION_SCALING = {"accel": {"positive_mps2": 2.4, "negative_mps2": 3.2},
                         "steer": {"max_tire_angle_rad": 0.83775804}}
# Names of the same action component (a consumer reorders actions by these): nuPlan's accel is the longitudinal one
ACTION_ALIASES = {"accel": "longitudinal"}

LAYOUTS = {LAYOUT_CARLA: {OBS_BEV: BEV_CHANNELS, OBS_MEASUREMENTS: MEASUREMENTS,
                          OBS_VALUE_MEASUREMENTS: VALUE_MEASUREMENTS},
           LAYOUT_NUPLAN: {OBS_BEV: NUPLAN_BEV_CHANNELS, OBS_MEASUREMENTS: NUPLAN_MEASUREMENTS,
                           OBS_VALUE_MEASUREMENTS: NUPLAN_VALUE_MEASUREMENTS},
           LAYOUT_VECTOR: {OBS_MEASUREMENTS: MEASUREMENTS, OBS_VALUE_MEASUREMENTS: VALUE_MEASUREMENTS,
                           **VECTOR_FEATURES}}


def layout_of(bev_channels: tuple[str, ...] | list[str]) -> str:
    """The layout whose BEV channels are ``bev_channels``; unnamed channels are the CARLA layout (what every spec
    and bundle meant before the names were recorded); ``"custom"`` for any other names."""
    names = tuple(bev_channels)
    if not names:
        return LAYOUT_CARLA
    return next((k for k, v in LAYOUTS.items() if v.get(OBS_BEV) == names), "custom")


def action_permutation(source: tuple[str, ...] | list[str], target: tuple[str, ...] | list[str]) -> list[int]:
    """Indices ``p`` with ``action_target = action_source[..., p]``, matching names through
    :data:`ACTION_ALIASES` (``accel`` is ``longitudinal``)."""
    canon = lambda names: [ACTION_ALIASES.get(n, n) for n in names]  # noqa: E731
    src, dst = canon(source), canon(target)
    if sorted(src) != sorted(dst):
        raise ValueError(f"actions {list(source)} cannot be mapped to {list(target)}")
    return [src.index(n) for n in dst]


# Route scenarios (envs/sim/scenarios.py): the types carl plays (longest6 v2's six, ../shared/docs/scenarios.md) and
# what can become of each in an episode, as ``episode/scenarios/<type>/<outcome>`` counts.
SCENARIO_TYPES = ("DynamicObjectCrossing", "SignalizedJunctionLeftTurn", "ControlLoss", "SignalizedJunctionRightTurn",
                  "OppositeVehicleRunningRedLight", "VehicleTurningRoute")
SCENARIO_OUTCOMES = ("triggered", "passed", "collided", "timed_out", "preempted", "not_reached")

# ---------------------------------------------------------------------------------------------- the info protocol
DONE = "done"  # [B] bool: the row's episode ended this step
EPISODE = "episode/"  # + a statistic of the episode that ended on the row ([B], valid where done)
FINAL_OBS = "final_obs/"  # + an observation key: the row's terminal observation (envs built with keep_final_obs)
INFO_KEYS = {
    DONE: "[B] bool: the row's episode ended this step (terminated | truncated)",
    EPISODE + "return": "sum of the episode's rewards",
    EPISODE + "length": "steps",
    EPISODE + "route_completion": "route completion, %",
    EPISODE + "infraction_score": "product of the infraction coefficients (and the min-speed factor)",
    EPISODE + "driving_score": "route completion x infraction score",
    EPISODE + "km": "km of route driven",
    EPISODE + "route_id": "the route (scenario) index the row drove",
    EPISODE + "outside_lanes_pct": "% of the route driven outside the lanes",
    EPISODE + "min_speed_factor": "Leaderboard 2.0's min-speed factor (1 under CaRL's rules)",
    EPISODE + "infractions/<name>": "count of each infraction (envs.sim.infractions.INFRACTIONS, min_speed)",
    EPISODE + "termination/<reason>": "1 for the reason the episode ended (a hard infraction, route_completed, or a "
                                       "backend's own: scenario_end, carl_collision, ...); all 0 for an episode "
                                       "cut for no driving reason (a lost CARLA server)",
    EPISODE + "scenarios/<type>/<outcome>": "route scenarios of each type (SCENARIO_TYPES) by what became of them "
                                            "(SCENARIO_OUTCOMES); worlds with route scenarios only",
    FINAL_OBS + "<key>": "the terminal observation of every row (keep_final_obs)",
}


def episode_stats(info: dict[str, Tensor]) -> dict[str, Tensor]:
    """The ``episode/...`` statistics of ``info``, keyed without the prefix."""
    return {k[len(EPISODE):]: v for k, v in info.items() if k.startswith(EPISODE)}


def final_obs(info: dict[str, Tensor]) -> dict[str, Tensor]:
    """The terminal observation in ``info`` (empty unless the env keeps it), keyed like the observation."""
    return {k[len(FINAL_OBS):]: v for k, v in info.items() if k.startswith(FINAL_OBS)}


class BatchedEnv(abc.ABC):
    """B environments on one device, stepped together, reset automatically."""

    num_envs: int
    device: torch.device
    observation_spec: dict[str, TensorSpec]
    action_spec: TensorSpec = TensorSpec((2,), torch.float32, -1.0, 1.0, ACTIONS)
    control_dt: float = CONTROL_DT  # s of simulated time per step

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> dict[str, torch.Tensor]:
        """Start a new episode in every environment; ``seed`` makes the whole batch reproducible."""

    @abc.abstractmethod
    def step(self, action: torch.Tensor) -> StepResult:
        """Advance every environment by one control step (``control_dt``)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (servers, processes). The built-in simulator holds none."""

    def state_dict(self) -> dict:
        """Everything needed to continue the same stream of episodes after a resume (RNG states, seeds)."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 - optional hook
        """Restore what :meth:`state_dict` returned."""
