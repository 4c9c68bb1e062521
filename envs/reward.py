"""CaRL's simple reward: the one implementation every backend uses.

Per step ``r = dRC * p_speed * p_ttc * p_comfort * p_lane`` (dRC = route completion gained, in percent, so a
whole route is worth 100), with dRC set to 0 while outside the route lanes, and a terminal penalty subtracted
when a collision or a red-light run ends the episode. The penalty windows (TTC, comfort) are reward state and
live here too, so CARLA, nuPlan and the built-in simulator cannot drift apart. Constants default to CaRL's values
(``../shared/docs/carl-reference.md`` §1).

``RewardConfig.mode`` picks the reward: ``"carl_carla"`` (default, above) or ``"carl_nuplan"``, CaRL's nuPlan reward
(``carl-reference.md`` §18; :func:`compute_reward_nuplan`, its own inputs :class:`NuplanRewardInputs`, state
:class:`NuplanRewardState` and constants :class:`NuplanRewardConfig` under ``RewardConfig.nuplan``). Its comfort term
uses nuPlan's comfort signals from :mod:`envs.comfort`, the same code as the closed-loop score.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from envs.api import COMFORT_METRICS, CONTROL_DT
from envs.comfort import COMFORT_BOUNDS, MIN_COMFORT_STATES, comfort_checks, comfort_signals
from envs.config import Checks
from envs.metrics.nuplan import SPEED_VIOLATION_MAX

REWARD_MODES = ("carl_carla", "carl_nuplan")
NUPLAN_ACCUMULATIONS = ("regular", "nuplan", "survival")
NUPLAN_TERM_ACCUMULATIONS = ("value", "terminal")


@dataclass
class NuplanRewardConfig:
    """Every constant of CaRL's nuPlan reward (``carl-reference.md`` §18), CaRL's value as default (the yaml
    ``default_reward_builder.yaml`` where it differs from the dataclass: ``survival_ratio``)."""

    accumulation: str = "regular"  # "regular" | "nuplan" | "survival" (§18.5)
    reward_factor: float = 100.0  # every accumulation is scaled by it
    survival_ratio: float = 0.2  # "survival": weight of the per-step survival bonus (dataclass 0.6, yaml 0.2)
    scenario_iterations: int = 150  # NUM_SCENARIO_ITERATIONS: the per-step bonuses of "nuplan"/"survival" are /150
    terminal_penalty: float = 0.0  # added (times reward_factor) on a terminating step; "regular"/"survival"
    collision_terminal_penalty: float = 0.0  # ... instead, when the step's hard constraint is a collision
    collision_stopped_speed: float = 0.05  # m/s: "non_stationary" collisions need ego speed >= this
    use_lane_distance: bool = True  # lane_distance "v1"
    lane_distance_threshold: float = 0.5  # m from the lane centre that is not penalised
    lane_distance_penalty: float = 0.5  # factor = 1 - penalty * normalised distance, in [1 - penalty, 1]
    lane_distance_eps: float = 1e-6  # added to the normaliser (CaRL's code)
    use_too_fast: bool = True  # the too-fast factor
    speeding_margin: float = SPEED_VIOLATION_MAX  # m/s over the limit at which too_fast reaches 0 (nuPlan's)
    speeding_margin_floor: float = 1e-3  # CaRL floors the margin so that 0 cannot divide
    use_off_route: bool = True  # off_route "v1"
    use_comfort: bool = True  # comfort "kinematics"
    comfort_accumulation: str = "value"  # "value" | "terminal" (a failed comfort check ends the episode; "regular")
    comfort_min_states: int = MIN_COMFORT_STATES  # factor 1.0 until the episode has this many ego states
    comfort_lon_acc: tuple[float, float] = COMFORT_BOUNDS["lon_acc"]  # nuPlan's bounds (envs.comfort), strict
    comfort_lat_acc: float = COMFORT_BOUNDS["lat_acc"]  # m/s², nuPlan's bound
    comfort_jerk: float = COMFORT_BOUNDS["jerk"]  # m/s³
    comfort_lon_jerk: float = COMFORT_BOUNDS["lon_jerk"]  # m/s³
    comfort_yaw_rate: float = COMFORT_BOUNDS["yaw_rate"]  # rad/s
    comfort_yaw_acc: float = COMFORT_BOUNDS["yaw_acc"]  # rad/s²
    use_ttc: bool = True  # ttc "v2", sticky
    ttc_factor: float = 0.5  # FAIL_TTC
    ttc_accumulation: str = "value"  # "value" | "terminal" (a failed TTC ends the episode; "regular")
    ttc_stopped_speed: float = 0.005  # m/s: at or below, the TTC check passes

    def comfort_bounds(self) -> dict[str, float | tuple[float, float]]:
        """The bounds in :data:`envs.comfort.COMFORT_BOUNDS` layout."""
        return {"lon_acc": tuple(self.comfort_lon_acc), "lat_acc": self.comfort_lat_acc, "jerk": self.comfort_jerk,
                "lon_jerk": self.comfort_lon_jerk, "yaw_rate": self.comfort_yaw_rate, "yaw_acc": self.comfort_yaw_acc}

    def validate(self, prefix: str = "reward.nuplan") -> None:
        """Raise one :class:`ConfigError` naming every bad constant and its fix."""
        checks = Checks()
        need = checks.need
        need(self.accumulation in NUPLAN_ACCUMULATIONS, f"{prefix}.accumulation={self.accumulation!r}: use one of "
             f"{', '.join(NUPLAN_ACCUMULATIONS)}")
        for name in ("comfort_accumulation", "ttc_accumulation"):
            v = getattr(self, name)
            need(v in NUPLAN_TERM_ACCUMULATIONS, f"{prefix}.{name}={v!r}: use one of "
                 f"{', '.join(NUPLAN_TERM_ACCUMULATIONS)}")
        for name in ("reward_factor", "survival_ratio", "terminal_penalty", "collision_terminal_penalty",
                     "collision_stopped_speed", "lane_distance_threshold", "lane_distance_penalty",
                     "lane_distance_eps", "speeding_margin", "speeding_margin_floor", "comfort_lat_acc",
                     "comfort_jerk", "comfort_lon_jerk", "comfort_yaw_rate", "comfort_yaw_acc", "ttc_factor",
                     "ttc_stopped_speed"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and math.isfinite(v), f"{prefix}.{name}={v}: must be a finite number")
        for name in ("reward_factor", "speeding_margin", "comfort_lat_acc", "comfort_jerk",
                     "comfort_lon_jerk", "comfort_yaw_rate", "comfort_yaw_acc"):
            v = getattr(self, name)
            need(not v <= 0, f"{prefix}.{name}={v}: must be > 0")
        for name in ("collision_stopped_speed", "lane_distance_threshold", "lane_distance_eps",
                     "speeding_margin_floor", "ttc_stopped_speed"):
            v = getattr(self, name)
            need(not v < 0, f"{prefix}.{name}={v}: must be >= 0")
        for name in ("survival_ratio", "lane_distance_penalty", "ttc_factor"):
            v = getattr(self, name)
            need(0 <= v <= 1, f"{prefix}.{name}={v}: must be in [0, 1]")
        need(self.scenario_iterations >= 1, f"{prefix}.scenario_iterations={self.scenario_iterations}: must be >= 1 "
             "(the per-step bonuses are divided by it; CaRL: 150)")
        need(self.comfort_min_states >= MIN_COMFORT_STATES,
             f"{prefix}.comfort_min_states={self.comfort_min_states}: must be >= {MIN_COMFORT_STATES} (the "
             f"yaw-acceleration fit of order 3 needs {MIN_COMFORT_STATES} states; CaRL: {MIN_COMFORT_STATES})")
        lo_hi = tuple(self.comfort_lon_acc)
        need(len(lo_hi) == 2 and lo_hi[0] < lo_hi[1],
             f"{prefix}.comfort_lon_acc={self.comfort_lon_acc}: give (min, max) with min < max, e.g. (-4.05, 2.40)")
        checks.done()


@dataclass
class RewardConfig:
    """Every constant of the reward, CaRL's value as default."""

    terminal_penalty: float = 1.0  # subtracted on collision / red-light termination
    use_outside_lanes: bool = True  # dRC = 0 while outside route lanes
    use_speeding: bool = True  # the speeding factor (p_speed)
    speeding_margin: float = SPEED_VIOLATION_MAX  # m/s over the limit at which p_speed reaches 0 (nuPlan's)
    use_ttc: bool = True  # the time-to-collision factor
    ttc_factor: float = 0.5  # reward factor while a TTC violation is penalised
    ttc_penalty_ticks: int = 500  # steps a TTC violation stays penalised
    ttc_times: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)  # s ahead at which the constant-velocity forecast is checked
    use_comfort: bool = True  # the comfort factor
    comfort_penalty_ticks: int = 500  # steps a comfort violation stays penalised
    # limits: lon acc range, |lat acc|, |jerk|, |lon jerk|, |yaw rate|, |yaw acc|
    comfort_lon_acc: tuple[float, float] = (-20.0, 10.0)
    comfort_lat_acc: float = 9.0  # m/s²
    comfort_jerk: float = 30.0  # m/s³
    comfort_lon_jerk: float = 30.0  # m/s³
    comfort_yaw_rate: float = 1.0  # rad/s
    comfort_yaw_acc: float = 3.0  # rad/s²
    use_lane_centre: bool = True  # the lane-centre factor (distance to the lane centre)
    survival_bonus: float = 0.0  # CaRL: off on CARLA
    mode: str = "carl_carla"  # "carl_carla" (the fields above) | "carl_nuplan" (the fields of `nuplan`)
    nuplan: NuplanRewardConfig = field(default_factory=NuplanRewardConfig)  # mode "carl_nuplan"

    def validate(self, prefix: str = "reward") -> None:
        """Raise one :class:`ConfigError` naming every bad constant."""
        checks = Checks()
        for name in ("terminal_penalty", "speeding_margin", "ttc_factor", "survival_bonus"):
            v = getattr(self, name)
            checks.need(v >= 0, f"{prefix}.{name}={v}: must be >= 0")
        checks.need(self.speeding_margin != 0, f"{prefix}.speeding_margin=0: must be > 0 (it divides the speed excess)")
        for name in ("ttc_penalty_ticks", "comfort_penalty_ticks"):
            checks.need(getattr(self, name) >= 0, f"{prefix}.{name}={getattr(self, name)}: must be >= 0")
        checks.need(0 <= self.ttc_factor <= 1, f"{prefix}.ttc_factor={self.ttc_factor}: must be in [0, 1]")
        checks.need(self.mode in REWARD_MODES, f"{prefix}.mode={self.mode!r}: use one of {', '.join(REWARD_MODES)}")
        checks.run(self.nuplan.validate, f"{prefix}.nuplan")
        checks.done()


@dataclass
class RewardInputs:
    """What a backend measures each step (all [B] unless noted)."""

    progress: Tensor  # route completion gained this step, percent
    outside_lanes: Tensor  # bool
    speed: Tensor  # m/s
    speed_limit: Tensor  # m/s
    ttc_violation: Tensor  # bool: a predicted overlap within the TTC horizon
    comfort_violation: Tensor  # bool [B, 6], order COMFORT_METRICS
    lane_offset_ratio: Tensor  # |lateral offset| / (lane width / 2); 0 inside junctions
    terminal_penalty: Tensor  # bool: the episode ends by collision or red light


@dataclass
class RewardState:
    ttc_ticks: Tensor  # [B] int
    comfort_ticks: Tensor  # [B, 6] int

    @classmethod
    def zeros(cls, batch: int, device: torch.device) -> "RewardState":
        return cls(torch.zeros(batch, dtype=torch.int32, device=device),
                   torch.zeros(batch, len(COMFORT_METRICS), dtype=torch.int32, device=device))

    def reset(self, mask: Tensor) -> None:
        self.ttc_ticks.masked_fill_(mask, 0)
        self.comfort_ticks.masked_fill_(mask.unsqueeze(-1), 0)


@dataclass
class RewardTerms:
    reward: Tensor
    factors: dict[str, Tensor] = field(default_factory=dict)  # for logging
    terminated: Tensor | None = None  # "carl_nuplan": the reward's own termination (hard constraint) [B] bool


def comfort_violations(lon_acc: Tensor, lat_acc: Tensor, jerk: Tensor, lon_jerk: Tensor, yaw_rate: Tensor,
                       yaw_acc: Tensor, cfg: RewardConfig) -> Tensor:
    """The six comfort checks -> bool [B, 6] in COMFORT_METRICS order."""
    lo, hi = cfg.comfort_lon_acc
    return torch.stack((
        (lon_acc < lo) | (lon_acc > hi),
        lat_acc.abs() > cfg.comfort_lat_acc,
        jerk.abs() > cfg.comfort_jerk,
        lon_jerk.abs() > cfg.comfort_lon_jerk,
        yaw_rate.abs() > cfg.comfort_yaw_rate,
        yaw_acc.abs() > cfg.comfort_yaw_acc,
    ), dim=-1)


def compute_reward(inp: RewardInputs, state: RewardState, cfg: RewardConfig) -> RewardTerms:
    """One step of CaRL's reward; updates the penalty windows in ``state`` in place. With
    ``cfg.mode == "carl_nuplan"`` this is :func:`compute_reward_nuplan` (``inp``/``state`` of its own types)."""
    if cfg.mode == "carl_nuplan" or isinstance(inp, NuplanRewardInputs):
        if cfg.mode != "carl_nuplan" or not isinstance(inp, NuplanRewardInputs):
            raise TypeError(f"reward.mode={cfg.mode!r} got {type(inp).__name__}: mode 'carl_nuplan' takes "
                            "NuplanRewardInputs and NuplanRewardState, mode 'carl_carla' RewardInputs and RewardState")
        return compute_reward_nuplan(inp, state, cfg)
    progress = inp.progress
    if cfg.use_outside_lanes:
        progress = torch.where(inp.outside_lanes, torch.zeros_like(progress), progress)
    one = torch.ones_like(progress)
    p_speed = one
    if cfg.use_speeding:
        excess = (inp.speed - inp.speed_limit).clamp(min=0.0)
        p_speed = (1.0 - excess / cfg.speeding_margin).clamp(min=0.0)
    p_ttc = one
    if cfg.use_ttc:
        state.ttc_ticks.copy_(torch.where(inp.ttc_violation, torch.full_like(state.ttc_ticks, cfg.ttc_penalty_ticks),
                                          (state.ttc_ticks - 1).clamp(min=0)))
        p_ttc = torch.where(state.ttc_ticks > 0, one * cfg.ttc_factor, one)
    p_comfort = one
    if cfg.use_comfort:
        state.comfort_ticks.copy_(torch.where(inp.comfort_violation,
                                              torch.full_like(state.comfort_ticks, cfg.comfort_penalty_ticks),
                                              (state.comfort_ticks - 1).clamp(min=0)))
        active = (state.comfort_ticks > 0).sum(-1).float()
        p_comfort = 1.0 - 0.5 * active / len(COMFORT_METRICS)
    p_lane = (1.0 - inp.lane_offset_ratio.clamp(0.0, 1.0)) if cfg.use_lane_centre else one
    reward = progress * p_speed * p_ttc * p_comfort * p_lane + cfg.survival_bonus
    reward = reward - cfg.terminal_penalty * inp.terminal_penalty.float()
    return RewardTerms(reward, {"speed": p_speed, "ttc": p_ttc, "comfort": p_comfort, "lane": p_lane})


# ================================================================================================ CaRL on nuPlan
@dataclass
class NuplanRewardInputs:
    """What the nuPlan backend measures each step for ``mode="carl_nuplan"`` (all [B] unless noted; geometry is the
    caller's, the rules are here). Optional fields left ``None`` count as "nothing there"."""

    rc: Tensor  # normalised projection of the ego centre onto the logged expert centre path, in [0, 1]
    off_road: Tensor  # bool: some ego corner is outside every drivable-area polygon (threshold 0 m)
    on_lane: Tensor  # bool: the current lane is a Lane (not a lane connector, not none)
    lane_center_dist: Tensor  # d_c: ego centre to the current lane's baseline, m
    lane_boundary_dist: Tensor  # d_b: ego centre to the nearer lane boundary, m
    speed: Tensor  # ego speed, m/s (nuPlan: the rear axle's, dynamic_car_state.speed)
    speed_limit: Tensor  # the current lane's limit, m/s; NaN (or inf) = no lane or no limit
    ego_in_route: Tensor  # bool: ego centre inside a route roadblock / roadblock-connector polygon
    expert_in_route: Tensor  # bool: the logged expert's centre at this iteration inside one
    ttc_violation: Tensor  # bool: the constant-velocity forecast collides within the horizon (v2 geometry)
    lon_acc: Tensor  # this state's centre body-frame acceleration, forward (envs.comfort.rear_axle_to_center_...)
    lat_acc: Tensor  # ... left
    heading: Tensor  # rad
    acc_magnitude: Tensor | None = None  # |rear-axle acceleration| (the jerk metric's input); None: hypot(lon, lat)
    overlap: Tensor | None = None  # [B, N] bool: ego box overlaps object slot j (a slot = one track for the episode)
    collision: Tensor | None = None  # bool: a collision found by the caller's own rule (or'ed with the overlap rule)
    red_light: Tensor | None = None  # bool: red-light hard constraint (off in CaRL)
    dt: float = CONTROL_DT  # s between the ego states (the env's step)


@dataclass
class NuplanRewardState:
    """Per-episode memory of CaRL's nuPlan reward (every field [B, ...], so rows reset by assignment or
    :meth:`reset`)."""

    rc_best: Tensor  # [B] running maximum of rc (starts at 0)
    collided: Tensor  # [B, N] bool: object slots collided with before (ignored afterwards)
    ttc_failed: Tensor  # [B] bool: sticky TTC failure
    acc_lon: Tensor  # [B, H] comfort history of the episode's ego states, oldest first
    acc_lat: Tensor
    acc_mag: Tensor
    heading: Tensor
    count: Tensor  # [B] int64: states in the history

    @classmethod
    def zeros(cls, batch: int, device: torch.device, num_objects: int = 0, history: int = 256,
              dtype: torch.dtype = torch.float32) -> NuplanRewardState:
        """``num_objects``: object slots of ``NuplanRewardInputs.overlap``; ``history``: ego states kept for the
        comfort term (one more than the longest episode in steps, to hold the initial state too; when full, the
        oldest state is dropped)."""
        if history < 1:
            raise ValueError(f"NuplanRewardState history={history}: must be >= 1 (the episode's ego states)")
        h = lambda: torch.zeros(batch, history, dtype=dtype, device=device)
        return cls(torch.zeros(batch, dtype=dtype, device=device),
                   torch.zeros(batch, num_objects, dtype=torch.bool, device=device),
                   torch.zeros(batch, dtype=torch.bool, device=device), h(), h(), h(), h(),
                   torch.zeros(batch, dtype=torch.long, device=device))

    def reset(self, mask: Tensor) -> None:
        """Start a new episode in the rows of ``mask`` [B] bool."""
        self.rc_best.masked_fill_(mask, 0.0)
        self.collided.masked_fill_(mask.unsqueeze(-1), False)
        self.ttc_failed.masked_fill_(mask, False)
        for t in (self.acc_lon, self.acc_lat, self.acc_mag, self.heading):
            t.masked_fill_(mask.unsqueeze(-1), 0.0)
        self.count.masked_fill_(mask, 0)

    def record_state(self, lon_acc: Tensor, lat_acc: Tensor, heading: Tensor, acc_magnitude: Tensor | None = None,
                     mask: Tensor | None = None) -> None:
        """Append one ego state to the comfort history of the rows in ``mask`` (default all). ``compute_reward``
        calls it with each step's state; the env calls it once after a reset with the episode's initial state (nuPlan
        counts it: CaRL's ``simulation_ego_states`` starts with it)."""
        B, H = self.acc_lon.shape
        if mask is None:
            mask = torch.ones(B, dtype=torch.bool, device=self.count.device)
        mag = torch.hypot(lon_acc, lat_acc) if acc_magnitude is None else acc_magnitude
        full = mask & (self.count >= H)
        at = self.count.clamp(max=H - 1)
        write = torch.arange(H, device=self.count.device)[None, :] == at[:, None]
        for buf, v in ((self.acc_lon, lon_acc), (self.acc_lat, lat_acc), (self.acc_mag, mag), (self.heading, heading)):
            shifted = torch.where(full[:, None], torch.roll(buf, -1, dims=1), buf)
            buf.copy_(torch.where(mask[:, None] & write, v.to(buf.dtype)[:, None], shifted))
        self.count.copy_(torch.where(mask, (self.count + 1).clamp(max=H), self.count))


def non_stationary_collision(overlap: Tensor, speed: Tensor, collided: Tensor,
                             stopped_speed: float = 0.05) -> tuple[Tensor, Tensor]:
    """CaRL's "non_stationary" collision: the ego box overlaps an object not collided with before while the ego
    moves (speed >= ``stopped_speed``). ``overlap``, ``collided`` [B, N] bool. Returns (collision [B], the updated
    memory [B, N]); every overlapped object is remembered, also when the ego stands (as CaRL does)."""
    new = overlap & ~collided
    hit = new.any(-1) & (speed >= stopped_speed)
    return hit, collided | overlap


def compute_reward_nuplan(inp: NuplanRewardInputs, state: NuplanRewardState, cfg: RewardConfig) -> RewardTerms:
    """One step of CaRL's nuPlan reward (``carl-reference.md`` §18) for every row; updates ``state`` in place.

    progress ΔRC = max(0, rc - rc_best); hard constraints T = collision | off_road | red_light; soft factors
    lane_distance, too_fast, off_route, comfort (fraction of nuPlan's six comfort checks holding over the episode's
    states, 1.0 below ``comfort_min_states``), ttc (sticky ``ttc_factor``). Accumulation (``cfg.nuplan.accumulation``):

    * "regular": r = F·(ΔRC·Π soft·[not T] + penalty·[T]); with ``comfort/ttc_accumulation="terminal"`` a failed
      comfort check / TTC also terminates;
    * "survival": r = F·(((1-ρ)·ΔRC·Π soft + ρ/I)·[not T] + penalty·[T]);
    * "nuplan": r = 0 if T, else F·off_route·lane_distance·(5·ΔRC + 5·[ttc = 1]/I + 4·too_fast/I +
      2·[comfort = 1]/I)/16;

    F = reward_factor, I = scenario_iterations, penalty = collision_terminal_penalty on a collision, else
    terminal_penalty (CaRL's code adds it on every step; both are 0 there, so only the terminating step gets it
    here). ``RewardTerms.terminated`` says which rows end."""
    c = cfg.nuplan
    rc = inp.rc.to(state.rc_best.dtype).clamp(0.0, 1.0)
    progress = (rc - state.rc_best).clamp(min=0.0)
    state.rc_best.copy_(torch.maximum(state.rc_best, rc))
    one = torch.ones_like(progress)
    no = torch.zeros_like(progress, dtype=torch.bool)

    # hard constraints
    collision = no if inp.collision is None else inp.collision.bool()
    if inp.overlap is not None:
        hit, memory = non_stationary_collision(inp.overlap.bool(), inp.speed, state.collided, c.collision_stopped_speed)
        state.collided.copy_(memory)
        collision = collision | hit
    off_road = inp.off_road.bool()
    red_light = no if inp.red_light is None else inp.red_light.bool()
    hard = collision | off_road | red_light

    # soft factors
    lane = one
    if c.use_lane_distance:
        dc, db = inp.lane_center_dist.to(one.dtype), inp.lane_boundary_dist.to(one.dtype)
        thr = c.lane_distance_threshold
        norm = ((dc - thr) / (dc + db - thr + c.lane_distance_eps)).clamp(0.0, 1.0)
        lane = torch.where(inp.on_lane.bool(), 1.0 - c.lane_distance_penalty * norm, one)
    too_fast = one
    if c.use_too_fast:
        excess = inp.speed.to(one.dtype) - inp.speed_limit.to(one.dtype)
        margin = max(c.speeding_margin, c.speeding_margin_floor)
        limited = torch.isfinite(inp.speed_limit) & (excess > 0)
        too_fast = torch.where(limited, (1.0 - excess / margin).clamp(min=0.0), one)
    off_route = one
    if c.use_off_route:
        off_route = torch.where(~inp.ego_in_route.bool() & inp.expert_in_route.bool(), torch.zeros_like(one), one)
    comfort = one
    checks = torch.ones(progress.shape[0], len(COMFORT_METRICS), dtype=torch.bool, device=progress.device)
    state.record_state(inp.lon_acc, inp.lat_acc, inp.heading, inp.acc_magnitude)
    if c.use_comfort:
        signals = comfort_signals(state.acc_lon, state.acc_lat, state.heading, state.count, inp.dt,
                                  state.acc_mag)
        checks = comfort_checks(signals, state.count, c.comfort_bounds(), c.comfort_min_states)
        comfort = checks.to(one.dtype).mean(-1)
    ttc = one
    if c.use_ttc:
        failing = inp.ttc_violation.bool() & (inp.speed > c.ttc_stopped_speed)
        state.ttc_failed.copy_(state.ttc_failed | failing)
        ttc = torch.where(state.ttc_failed, torch.full_like(one, c.ttc_factor), one)

    # accumulation
    soft = lane * too_fast * off_route * comfort * ttc
    penalty = torch.where(collision, torch.full_like(one, c.collision_terminal_penalty),
                          torch.full_like(one, c.terminal_penalty))
    terminated = hard
    if c.accumulation == "nuplan":
        it = float(c.scenario_iterations)
        raw = (5.0 * progress + 5.0 * (ttc == 1.0).to(one.dtype) / it + 4.0 * too_fast / it
               + 2.0 * (comfort == 1.0).to(one.dtype) / it) / 16.0
        reward = torch.where(hard, torch.zeros_like(one), raw * off_route * lane * c.reward_factor)
    else:
        if c.accumulation == "survival":
            raw = (1.0 - c.survival_ratio) * progress * soft + c.survival_ratio / c.scenario_iterations
        else:
            raw = progress * soft
            if c.comfort_accumulation == "terminal":
                terminated = terminated | (comfort < 1.0)
            if c.ttc_accumulation == "terminal":
                terminated = terminated | (ttc < 1.0)
        reward = torch.where(terminated, penalty, raw) * c.reward_factor
    factors = {"progress": progress, "lane_distance": lane, "too_fast": too_fast, "off_route": off_route,
               "comfort": comfort, "ttc": ttc, "collision": collision, "off_road": off_road,
               "comfort_checks": checks}
    return RewardTerms(reward, factors, terminated)
