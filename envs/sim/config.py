"""Configuration of the built-in simulator: plain dataclasses, validated once with actionable errors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envs.api import CONTROL_DT
from envs.config import Checks
from envs.maps.procedural import ProceduralConfig
from envs.sim.criteria import RULES
from envs.reward import RewardConfig

@dataclass
class VectorConfig:
    """The vector observation's sizes (``observation=vector``, :mod:`envs.sim.vector_obs`): how many of each entity,
    how far apart and how far out. Every set is padded to its count with a validity flag."""

    route_points: int = 20  # route points ahead of the ego
    route_spacing: float = 4.0  # m between consecutive route points (20 x 4 m: 80 m ahead)
    lanes: int = 32  # nearest lane-centre points around the ego
    lane_spacing: float = 5.0  # m between lane-centre points along a lane
    lane_radius: float = 40.0  # m: lane points farther from the ego are masked
    # nearest actors of each type (None: as many as the environment has slots, scenario actors' included; more than
    # the slots: padded with empty rows)
    vehicles: int | None = None  # nearest vehicles (None: every vehicle slot)
    pedestrians: int | None = None  # nearest pedestrians (None: every pedestrian slot)
    statics: int | None = None  # nearest static objects (None: every static slot)
    actor_radius: float = 60.0  # m: actors farther from the ego are masked
    stops: int = 2  # next stop lines (traffic lights, stop signs) on the route
    # vehicles and pedestrians also say where (route metres ahead) and when (s) their constant-velocity path first
    # meets the route ahead (envs.api.PATH_FEATURES): the gap to accept in a stream, the time a car behind needs
    path_conflicts: bool = False
    # the route scenarios' vehicles (junction streams, the cut-in, the emergency vehicle) meet the route along their
    # scripted paths (sampled every 0.5 s at their present speed), not a straight line: a stream bending through a
    # junction is flagged before it turns (docs/training.md, "Paths that bend"); where carl does not play the
    # scenarios (the Leaderboard agent, nuPlan's logs) the straight line stays. Needs path_conflicts
    scripted_paths: bool = False
    # torch.compile the observation's fixed-shape stages (route, actors, stop lines): ~2x faster on a 2-core CPU at
    # batch 1024 (docs/simulator.md, "Compiled stages"); each batch size compiles on its first step (seconds, cached
    # on disk by torch); needs a C++ compiler torch inductor supports
    compile: bool = False

    def validate(self, prefix: str) -> None:
        checks = Checks()
        for key in ("route_points", "lanes", "vehicles", "pedestrians", "statics", "stops"):
            n = getattr(self, key)
            checks.need(n is None or 1 <= n <= 4096, f"{prefix}.{key}={n!r}: an entity count must be in [1, 4096]")
        for key in ("route_spacing", "lane_spacing", "lane_radius", "actor_radius"):
            v = getattr(self, key)
            checks.need(0 < v <= 1000, f"{prefix}.{key}={v!r}: must be in (0, 1000] metres")
        checks.need(self.path_conflicts or not self.scripted_paths,
                    f"{prefix}.scripted_paths=true needs {prefix}.path_conflicts=true (it changes how those path "
                    "features are measured): set both, or drop scripted_paths")
        checks.done()


OBSERVATIONS = ("bev", "vector")


@dataclass
class SimConfig:
    """Everything the simulator needs. Defaults: a small procedural world with light traffic."""

    # --- map and routes
    map: str = "procedural"  # "procedural", a CARLA town ("Town01"...), or a path to .xodr / lane-graph .npz
    # several maps in one world (any mix of the names `map` takes), each episode on one of them drawn with
    # `map_weights` (default: equal); replaces `map` when given
    maps: tuple[str, ...] = ()
    map_weights: tuple[float, ...] = ()  # sampling weight of each of `maps` (default: equal)
    procedural: ProceduralConfig = field(default_factory=ProceduralConfig)
    town_seeds: tuple[int, ...] = (0, 1, 2, 3)  # procedural towns used for training
    eval_town_seeds: tuple[int, ...] = (1000, 1001)  # held-out towns for route_split="eval"
    route_split: str = "train"  # "train" (random routes, shuffled) or "eval" (fixed held-out routes)
    route_file: str | None = None  # Leaderboard route XML: its routes replace random routes
    route_length: tuple[float, float] = (150.0, 400.0)  # m, (min, max) length of random routes
    route_turn_bias: float = 0.0  # random routes take turning successors (1 + bias) times as often as straight ones
    route_junction_start: float = 0.0  # share of random routes that start 5-50 m before a junction (Leaderboard-like)
    route_lane_changes: bool = False  # random routes change to a same-direction neighbour lane (p 1/2 per lane), as longest6's do
    num_routes: int = 512  # size of the random route bank
    route_scenarios: bool = True  # play the route file's scenarios (Leaderboard 2.0 files: longest6's 429); false: drive its routes without them
    scenario_density: float = 0.0  # scenarios per km placed on random (training) routes (longest6 v2: 429 on 58 km, 7.4/km)
    # relative frequency of the six types on random routes (envs.maps.scenarios.SCENARIO_TYPES order; longest6 v2's counts)
    scenario_weights: tuple[float, float, float, float, float, float] = (116.0, 112.0, 80.0, 76.0, 43.0, 2.0)
    scenario_start: float = 0.0  # share of random routes (with a scenario) cut to start 20-60 m before one of their scenarios: more encounters per sample
    first_route: int = 0  # route_file / eval split: row i starts with route first_route + i (a slice of the file)
    route_stride: int = 0  # ... and then drives + stride, + 2 stride, ...; 0 = num_envs (CARLA workers: the worker count)
    map_ppm: float = 4.0  # resolution of the map raster (off-road, lane lookups, BEV source)
    cache_dir: str | None = None  # compiled map cache; default ~/.cache/carl/maps
    # --- actors (maximum per environment; padded tensors)
    traffic: bool = True
    num_vehicles: int = 12  # vehicle slots per environment
    num_pedestrians: int = 4  # pedestrian slots per environment
    num_statics: int = 2  # parked-obstacle slots per environment
    # "fixed": num_vehicles around every ego | "leaderboard": each CARLA town's background vehicle count of the
    # Leaderboard (LEADERBOARD_VEHICLES) per lane km, times the lane km around the ego, at most num_vehicles
    traffic_density: str = "fixed"
    # --- observation
    # "bev": CaRL's 10-channel BEV (every CaRL preset) | "vector": object-level sets for a set-encoder policy
    # (model.name=set; envs/sim/vector_obs.py, sizes in `vector`)
    observation: str = "bev"
    vector: VectorConfig = field(default_factory=VectorConfig)
    bev: bool = True  # draw the BEV (false: a zero BEV of the same shape, for speed)
    bev_size: int = 128  # BEV pixels per side (CaRL: 256)
    bev_ppm: float = 2.0  # BEV pixels per metre
    bev_ego_from_bottom: int = 50  # BEV rows behind the ego (CaRL: 100 of 256)
    route_points_drawn: int = 150  # route points (1 m apart) ahead drawn in the route channel
    keep_final_obs: bool = False  # put the terminal observation in info["final_obs/<key>"]
    # --- dynamics and timing
    dt: float = CONTROL_DT  # s per step (the control period; CARLA ticks at it too)
    max_steer: float = 0.6  # rad, front wheel angle at |steer| = 1
    wheelbase: float = 2.9  # m, of the kinematic bicycle
    max_accel: float = 4.0  # m/s² at full throttle
    max_brake: float = 8.0  # m/s² at full brake
    ego_half_extent: tuple[float, float] = (2.45, 1.05)  # m, the ego's half length and half width (CaRL's Lincoln MKZ)
    light_green: float = 8.0  # s of green per phase of the light cycle
    light_yellow: float = 2.0  # s of yellow per phase
    light_all_red: float = 1.0  # s of all-red between phases
    # --- episode ends (CaRL's values; rules="leaderboard" uses Leaderboard 2.0's instead, see envs/sim/criteria.py)
    rules: str = "carl"  # "carl": every hard infraction ends the episode (training) | "leaderboard": LB 2.0 scoring
    max_time: float = 1200.0  # s: an episode ends by timeout after this (CaRL's rules)
    blocked_time: float = 90.0  # s below blocked_speed that end an episode as blocked (CaRL's rules)
    blocked_speed: float = 0.1  # m/s under which the ego counts as standing
    # InRouteTest (CaRL's and Leaderboard 2.0's): deviated at route_deviation m from the route, or once the route
    # progress made route_deviation_safe m or more away exceeds route_deviation_fraction of the route (0 = rule off)
    route_deviation: float = 30.0
    route_deviation_safe: float = 15.0  # m from the route within which progress never counts as deviating
    route_deviation_fraction: float = 0.3  # share of the route driven off it that deviates (0 = off)
    off_road_fraction: float = 0.95  # share of the ego box off the road that counts as off-road
    reward: RewardConfig = field(default_factory=RewardConfig)

    def validate(self, prefix: str = "env.options") -> "SimConfig":
        """Check every value; all problems are raised together as one :class:`ConfigError` (keys under ``prefix``)."""
        checks = Checks()

        def need(cond: bool, key: str, fix: str) -> None:
            checks.need(cond, f"{prefix}.{key}={getattr(self, key)!r}: {fix}")

        need(self.route_split in ("train", "eval"), "route_split", "use 'train' or 'eval'")
        need(self.observation in OBSERVATIONS, "observation",
             "use 'bev' (CaRL's BEV, model.name=carl) or 'vector' (object-level sets, model.name=set)")
        need(not self.map_weights or len(self.map_weights) == len(self.maps), "map_weights",
             f"give one weight per map of env.options.maps ({len(self.maps)} maps: {list(self.maps)}), or none for equal "
             "weights")
        need(all(w >= 0 for w in self.map_weights) and (not self.map_weights or sum(self.map_weights) > 0),
             "map_weights", "weights must be >= 0 with a positive sum")
        need(len(set(self.maps)) == len(self.maps), "maps", "name each map once (weight it with env.options.map_weights)")
        need(0 <= self.route_junction_start <= 1, "route_junction_start", "must be a share in [0, 1]")
        need(self.route_turn_bias >= 0, "route_turn_bias", "must be >= 0 (0 = every successor equally likely)")
        need(self.traffic_density in ("fixed", "leaderboard"), "traffic_density",
             "use 'fixed' (num_vehicles everywhere) or 'leaderboard' (CARLA Leaderboard's per-town density)")
        need(self.rules in RULES, "rules",
             "use 'carl' (CaRL's training terminations) or 'leaderboard' (Leaderboard 2.0 scoring)")
        need(0 < self.route_deviation_safe <= self.route_deviation, "route_deviation_safe",
             "must be in (0, route_deviation]")
        need(0 <= self.route_deviation_fraction <= 1, "route_deviation_fraction", "must be in [0, 1] (0 = rule off)")
        need(len(self.route_length) == 2 and 10 <= self.route_length[0] <= self.route_length[1], "route_length",
             "give (min, max) metres with 10 <= min <= max")
        need(self.num_routes >= 1, "num_routes", "must be >= 1")
        need(0 <= self.scenario_density <= 50, "scenario_density", "must be in [0, 50] scenarios per km")
        need(0 <= self.scenario_start <= 1, "scenario_start",
             "must be a share in [0, 1] (0: routes start where they were drawn)")
        need(len(self.scenario_weights) == 6 and all(w >= 0 for w in self.scenario_weights)
             and sum(self.scenario_weights) > 0, "scenario_weights",
             "give six weights >= 0 with a positive sum (DynamicObjectCrossing, SignalizedJunctionLeftTurn, ControlLoss, "
             "SignalizedJunctionRightTurn, OppositeVehicleRunningRedLight, VehicleTurningRoute)")
        need(self.first_route >= 0, "first_route", "must be >= 0")
        need(self.route_stride >= 0, "route_stride", "must be >= 0 (0 = num_envs)")
        need(self.map_ppm > 0 and self.bev_ppm > 0, "map_ppm", "pixels per metre must be > 0")
        for key in ("num_vehicles", "num_pedestrians", "num_statics"):
            need(getattr(self, key) >= 0, key, "must be >= 0")
        need(8 <= self.bev_size <= 1024, "bev_size", "must be in [8, 1024]")
        need(0 <= self.bev_ego_from_bottom < self.bev_size, "bev_ego_from_bottom", "must be in [0, bev_size)")
        need(0 < self.dt <= 1.0, "dt", "must be in (0, 1] seconds")
        need(0 < self.off_road_fraction <= 1.0, "off_road_fraction", "must be in (0, 1]")
        for key in ("max_time", "blocked_time", "route_deviation", "max_accel", "max_brake", "max_steer", "wheelbase",
                    "light_green", "light_yellow"):
            need(getattr(self, key) > 0, key, "must be > 0")
        need(len(self.town_seeds) >= 1, "town_seeds", "give at least one seed")
        need(not set(self.town_seeds) & set(self.eval_town_seeds), "eval_town_seeds",
             "held-out towns must differ from town_seeds")
        checks.run(self.reward.validate, f"{prefix}.reward")
        checks.run(self.vector.validate, f"{prefix}.vector")
        checks.done()
        return self


def check_options(options: dict[str, Any]) -> None:
    """Validate the simulator's ``env.options`` (keys, types, ranges) without building anything."""
    from envs.config import from_dict

    from_dict(SimConfig, options, "env.options").validate()
