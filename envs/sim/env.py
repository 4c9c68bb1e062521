"""The simulator core: ``B`` environments stepped in one call on one torch device.

One step: the ego moves -> the other actors move -> route progress and infraction checks -> CaRL's reward ->
auto-reset of finished environments -> observation. Every stage is a batched tensor function; nothing loops over
environments or actors. How the world moves is up to the core's parts (:mod:`envs.sim.parts`): by default the
built-in simulator's (kinematic bicycle, IDM traffic, light cycle); the CARLA and nuPlan backends assemble their own.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
import torch
from torch import Tensor

from envs.api import (BatchedEnv, StepResult)
from envs.config import ConfigError
from envs.reward import RewardInputs, RewardState, comfort_violations, compute_reward
from envs.sim import agents, criteria, infractions
from envs.sim.agents import Pedestrians, Statics, Vehicles
from envs.sim.config import SimConfig
from envs.sim.criteria import CriteriaState
from envs.sim.infractions import HARD, INFRACTIONS, TERMINAL_PENALTY
from envs.sim.observation import upcoming_stop_lines
from envs.sim.parts import (ActorSource, CarlaObserver, EgoDynamics, KinematicBicycle, LightCycle, LightSource,
                            Observer, RouteStarts, SimTraffic, StartSource, StepHook)
from envs.sim.world import World, load_world

TERMINATIONS = HARD + ("route_completed",)
# Leaderboard mode: the events that end a route (the others are recorded and the route goes on)
ROUTE_ENDING_LB = torch.tensor([k in ("route_deviation", "blocked", "timeout") for k in HARD])


@dataclass
class SimState:
    """Everything that changes during an episode, batched over environments."""

    ego_xy: Tensor  # [B,2]
    ego_yaw: Tensor
    ego_speed: Tensor
    ego_vel_local: Tensor  # [B,2] velocity in the ego frame (forward, left), m/s
    gear: Tensor  # [B] float
    last_action: Tensor  # [B,3] steer, throttle, brake
    route_id: Tensor
    route_idx: Tensor
    rc: Tensor  # route completion %, 2 decimals
    t: Tensor  # seconds since episode start
    steps: Tensor
    still_time: Tensor  # seconds below the blocked speed
    light_offset: Tensor  # [B,J]
    stop_done: Tensor  # the next stop sign on the route has been obeyed
    hist_speed: Tensor  # [B,HISTORY]
    hist_yaw: Tensor
    veh: Vehicles
    ped: Pedestrians
    statics: Statics
    reward_state: RewardState
    ep_return: Tensor
    counts: Tensor  # [B, len(INFRACTIONS)] int
    outside_m: Tensor  # metres of route progress made outside the lanes
    prev_soft: Tensor  # [B,4] bool: speeding, ttc, comfort, outside last step (to count events on rising edges)
    crit: CriteriaState


def assign_rows(state, rows: Tensor, fresh) -> None:
    """Write ``fresh`` (a state tree for ``len(rows)`` environments) into rows ``rows`` of ``state``, in place."""
    for f in dataclasses.fields(state):
        old, new = getattr(state, f.name), getattr(fresh, f.name)
        if dataclasses.is_dataclass(old):
            assign_rows(old, rows, new)
        else:
            old[rows] = new


class SimEnv(BatchedEnv):
    """CaRL's task on the simulator core, with the parts that move the world (:mod:`envs.sim.parts`); the defaults
    are the built-in simulator's (``docs/simulator.md``: the model and its limits).

    ``state_type`` is the state dataclass the core builds (a subclass of :class:`SimState` carries the parts' own
    per-row state); ``observer``: the observation part (default CaRL's CARLA observation,
    :class:`~envs.sim.parts.CarlaObserver`); ``check_stop_lines=False`` turns off the red-light and stop-sign
    checks; ``ending_events``: the hard infractions that end an episode under CaRL's rules (the others are only
    counted)."""

    def __init__(self, cfg: SimConfig, num_envs: int, device: str | torch.device = "cpu", seed: int = 0,
                 world: World | None = None, *, starts: StartSource | None = None,
                 ego: EgoDynamics | None = None, actors: ActorSource | None = None, lights: LightSource | None = None,
                 hooks: tuple[StepHook, ...] = (), state_type: type[SimState] = SimState,
                 observer: Observer | None = None, check_stop_lines: bool = True,
                 ending_events: tuple[str, ...] = HARD):
        if num_envs < 1:
            raise ValueError(f"num_envs={num_envs}: need at least one environment")
        self.cfg = cfg.validate()
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.world = world if world is not None else load_world(cfg, self.device)
        self.gen = torch.Generator(device=self.device)
        self.seed = seed
        self.gen.manual_seed(seed)
        self.num_vehicles = max(1, cfg.num_vehicles)
        self.num_pedestrians = max(1, cfg.num_pedestrians)
        self.num_statics = max(1, cfg.num_statics)
        self.map_vehicles = agents.vehicles_per_map(self.world, cfg.num_vehicles, cfg.traffic_density) * cfg.traffic
        self.ego_half = torch.tensor(cfg.ego_half_extent, device=self.device).expand(num_envs, 2)
        self.route_stride = cfg.route_stride or num_envs  # rows advance by this many routes
        self.next_route = self._first_routes()
        self._lb_ending = ROUTE_ENDING_LB.to(self.device)
        unknown = set(ending_events) - set(HARD)
        if unknown:
            raise ValueError(f"ending_events: unknown {sorted(unknown)}; use names of {HARD}")
        self._ending = torch.tensor([k in ending_events for k in HARD], device=self.device)
        self.observer = observer if observer is not None else CarlaObserver()  # the observation (a part)
        self.observer.bind(self)
        self.observation_spec = self.observer.spec()
        self.state: SimState | None = None
        self.state_type = state_type
        self.check_stop_lines = check_stop_lines
        self.starts = starts if starts is not None else RouteStarts()
        self.ego = ego if ego is not None else KinematicBicycle()
        self.actors = actors if actors is not None else SimTraffic()
        self.lights = lights if lights is not None else LightCycle()
        self.hooks = tuple(hooks)
        if cfg.reward.mode != "carl_carla" and not any(type(h).reward is not StepHook.reward for h in self.hooks):
            raise ConfigError(f"reward.mode={cfg.reward.mode!r} needs inputs this backend does not measure (CaRL's "
                              "nuPlan reward: env=nuplan); use reward.mode=carl_carla here")
        for part in (self.starts, self.ego, self.actors, self.lights, *self.hooks):
            part.bind(self)

    # ------------------------------------------------------------------ episode starts
    def _first_routes(self) -> Tensor:
        return (self.cfg.first_route + torch.arange(self.num_envs, device=self.device)) % self.world.num_routes

    def _initial_state(self, rows: Tensor) -> SimState:
        """Fresh episodes for environments ``rows`` (a state tree of ``len(rows)`` rows), built by the parts."""
        B, dev = len(rows), self.device
        zeros = torch.zeros(B, device=dev)
        zi = torch.zeros(B, dtype=torch.long, device=dev)
        s = self.state_type(  # None: filled by the parts below
            ego_xy=None, ego_yaw=None, ego_speed=None, ego_vel_local=None, gear=zeros + 1.0,
            last_action=torch.zeros(B, 3, device=dev), route_id=self.starts.pick(rows), route_idx=zi.clone(),
            rc=zeros.clone(), t=zeros.clone(), steps=zi.clone(), still_time=zeros.clone(), light_offset=None,
            stop_done=torch.zeros(B, dtype=torch.bool, device=dev), hist_speed=None, hist_yaw=None,
            veh=None, ped=None, statics=None, reward_state=RewardState.zeros(B, dev), ep_return=zeros.clone(),
            counts=torch.zeros(B, len(INFRACTIONS), dtype=torch.long, device=dev), outside_m=zeros.clone(),
            prev_soft=torch.zeros(B, 4, dtype=torch.bool, device=dev), crit=CriteriaState.zeros(B, dev))
        self.starts.place(s, rows)
        self.ego.reset(s, rows)
        self.actors.reset(s, rows)
        self.lights.reset(s, rows)
        for hook in self.hooks:
            hook.start(s, rows)
        return s

    def reset(self, seed: int | None = None) -> dict[str, Tensor]:
        if seed is not None:
            self.seed = seed
            self.gen.manual_seed(seed)
        self.next_route = self._first_routes()
        self.state = self._initial_state(torch.arange(self.num_envs, device=self.device))
        self._advance_route_assignment(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))
        return self._observe(self.state)

    def _advance_route_assignment(self, done: Tensor) -> None:
        self.next_route = torch.where(done, (self.next_route + self.route_stride) % self.world.num_routes,
                                      self.next_route)

    # ------------------------------------------------------------------ one step
    def step(self, action: Tensor) -> StepResult:
        if self.state is None:
            raise RuntimeError("call reset() before step()")
        action = torch.as_tensor(action, device=self.device, dtype=torch.float32)
        if action.shape != (self.num_envs, 2):
            raise ValueError(f"action has shape {tuple(action.shape)}; expected ({self.num_envs}, 2) "
                             "(steer, longitudinal) in [-1, 1]")
        if torch.isnan(action).any():
            rows = torch.nonzero(torch.isnan(action).any(1)).flatten().tolist()[:8]
            raise ValueError(f"action contains NaN in environments {rows}; actions must be finite in [-1, 1]")
        action = action.clamp(-1.0, 1.0)  # documented clip
        s, w, cfg = self.state, self.world, self.cfg
        rcfg = cfg.reward
        self.ego.step(s, action)
        self.actors.step(s)
        s.t = s.t + cfg.dt
        s.steps = s.steps + 1
        self.lights.step(s)

        # route completion, route deviation and lane relations
        leaderboard = cfg.rules == "leaderboard"
        c = s.crit
        new_idx = infractions.route_progress(w, s.route_id, s.route_idx, s.ego_xy)
        if self.check_stop_lines:
            stops_info = self._stop_lines(s, s.route_idx, new_idx)
        else:
            none = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
            stops_info = none, none.clone()
        rc = infractions.route_completion(w, s.route_id, new_idx)
        completed = torch.zeros_like(rc, dtype=torch.bool)
        if leaderboard:  # RouteCompletionTest's success: beyond 99 % and within 10 m of the end counts as 100 %
            end = w.route_pts[s.route_id, w.route_n[s.route_id] - 1]
            completed = (rc > criteria.COMPLETED_RC) & ((s.ego_xy - end).norm(dim=-1) < criteria.COMPLETED_END_DIST)
            rc = torch.where(completed, torch.full_like(rc, 100.0), rc)
        progress = rc - s.rc
        travelled = w.route_cum[s.route_id, new_idx] - w.route_cum[s.route_id, s.route_idx]
        s.route_idx, s.rc = new_idx, rc
        deviated, c.dev_idx, c.out_route_m = infractions.route_deviation(
            w, s.route_id, c.dev_idx, s.ego_xy, c.out_route_m, cfg.route_deviation_safe, cfg.route_deviation,
            cfg.route_deviation_fraction)
        lane = infractions.lane_measures(w, s.ego_xy, s.ego_yaw)
        c.wrong_way = infractions.wrong_way(lane, s.ego_yaw, c.prev_lane, c.prev_lane_yaw, c.prev_junction,
                                            c.wrong_way)
        c.prev_lane = torch.where(lane["found"], lane["lane"], c.prev_lane)
        c.prev_lane_yaw = torch.where(lane["found"], lane["lane_yaw"], c.prev_lane_yaw)
        c.prev_junction = torch.where(lane["found"], lane["junction"], c.prev_junction)
        outside = lane["off_lane"] | c.wrong_way

        # infractions
        overlaps = infractions.collisions(s.ego_xy, s.ego_yaw, self.ego_half, {
            "vehicle": (s.veh.xy, s.veh.yaw, s.veh.half, s.veh.valid),
            "pedestrian": (s.ped.xy, s.ped.yaw, torch.full_like(s.ped.xy, agents.PEDESTRIAN_HALF), s.ped.valid),
            "static": (s.statics.xy, s.statics.yaw, s.statics.half, s.statics.valid)})
        hit_class, hit_key = criteria.first_hit(overlaps)
        if leaderboard:  # CollisionTest's merging; the hit actor leaves the world (no contact physics here)
            recorded = criteria.record_collisions(c, hit_class, hit_key, s.ego_xy, s.ego_speed, s.t)
            self._remove_hit_actors(s, overlaps, hit_class >= 0)
            hits = {name: recorded & (hit_class == i) for i, name in enumerate(criteria.ACTOR_CLASSES)}
            blocked_speed, blocked_time = criteria.LB_BLOCKED_SPEED, criteria.LB_BLOCKED_TIME
            criteria.extend_timeout(c, travelled, lane["speed_limit"])
            timeout = s.t > c.timeout
        else:
            hits = {name: hit.any(1) for name, hit in overlaps.items()}
            blocked_speed, blocked_time = cfg.blocked_speed, cfg.blocked_time
            timeout = s.t > cfg.max_time
        s.still_time = torch.where(s.ego_speed < blocked_speed, s.still_time + cfg.dt, torch.zeros_like(s.t))
        hard = {
            "collision_vehicle": hits["vehicle"], "collision_pedestrian": hits["pedestrian"],
            "collision_static": hits["static"], "red_light": stops_info[0], "stop_sign": stops_info[1],
            "off_road": infractions.off_road(w, s.ego_xy, s.ego_yaw, self.ego_half, cfg.off_road_fraction),
            "route_deviation": deviated,
            "blocked": s.still_time > blocked_time + 1e-3,  # "more than": robust to the sum of dt in float32
            "timeout": timeout,
        }
        hard_t = torch.stack([hard[k] for k in HARD], -1)
        if leaderboard:
            off_road_now = hard["off_road"]  # counted once per excursion, not per tick
            hard_t[:, HARD.index("off_road")] = off_road_now & ~c.off_road
            c.off_road = off_road_now
            ending_t = hard_t & self._lb_ending
            terminated = ending_t.any(-1)
            truncated = (completed | (s.route_idx >= w.route_n[s.route_id] - 1)) & ~terminated
            traffic_speed, has_traffic = criteria.background_speed(s.veh.speed, s.veh.valid)
            criteria.update_min_speed(c, w.route_cum[s.route_id, s.route_idx], w.route_len[s.route_id], s.ego_speed,
                                      traffic_speed, has_traffic, terminated | truncated)
        else:
            ending_t = hard_t & self._ending
            terminated = ending_t.any(-1)
            truncated = (s.route_idx >= w.route_n[s.route_id] - 2) & ~terminated
        for hook in self.hooks:
            ends = hook.ends(s)
            if ends is not None:
                truncated = truncated | (ends & ~terminated)

        # soft penalties and the reward
        a_xy, a_yaw, a_speed, a_half, a_valid = self.obstacles(s, include_ego=False)
        ttc = infractions.ttc_violation(s.ego_xy, s.ego_yaw, s.ego_speed, self.ego_half, a_xy, a_yaw, a_speed, a_half,
                                        a_valid, rcfg.ttc_times)
        s.hist_speed = torch.cat((s.hist_speed[:, 1:], s.ego_speed.unsqueeze(1)), 1)
        s.hist_yaw = torch.cat((s.hist_yaw[:, 1:], s.ego_yaw.unsqueeze(1)), 1)
        comfort = comfort_violations(*infractions.comfort_metrics(s.hist_speed, s.hist_yaw, s.steps, cfg.dt), rcfg)
        terminal_penalty = torch.stack([hard_t[:, HARD.index(k)] for k in TERMINAL_PENALTY], -1).any(-1)
        if rcfg.mode == "carl_carla":
            reward = compute_reward(RewardInputs(
                progress=progress, outside_lanes=outside, speed=s.ego_speed, speed_limit=lane["speed_limit"],
                ttc_violation=ttc, comfort_violation=comfort, lane_offset_ratio=lane["lane_ratio"],
                terminal_penalty=terminal_penalty), s.reward_state, rcfg).reward
        else:
            reward = torch.zeros_like(progress)  # the backend's hook gives it (checked in __init__)
        for hook in self.hooks:
            own = hook.reward(s)
            if own is not None:  # a backend's own reward and the episodes its hard constraints end
                reward, ends = own
                terminated = terminated | ends
                truncated = truncated & ~terminated
        s.ep_return = s.ep_return + reward

        # episode bookkeeping: hard infractions, and soft ones counted on their rising edge
        soft = torch.stack((s.ego_speed > lane["speed_limit"], ttc, comfort.any(-1), outside), -1)
        rising = soft & ~s.prev_soft
        s.prev_soft = soft
        s.counts = s.counts + torch.cat((hard_t, rising), -1).long()
        s.outside_m = s.outside_m + torch.where(outside, travelled, torch.zeros_like(travelled))

        done = terminated | truncated
        info = self._episode_info(s, done, ending_t, truncated)
        if cfg.keep_final_obs:
            for k, v in self._observe(s, speed_limit=lane["speed_limit"]).items():
                info[f"final_obs/{k}"] = v
        for hook in self.hooks:
            truncated = hook.end_step(s, terminated, truncated, info)
            done = terminated | truncated
        # auto-reset finished environments, keep the traffic around the others alive
        if bool(done.any()):  # one host sync; skips building fresh episodes on most steps
            rows = torch.nonzero(done).flatten()
            assign_rows(s, rows, self._initial_state(rows))
            self._advance_route_assignment(done)
        self.actors.refresh(s)
        obs = self._observe(s)
        return StepResult(obs, reward, terminated, truncated, info)

    def obstacles(self, s: SimState, include_ego: bool, include_statics: bool = True) -> tuple[Tensor, ...]:
        """All actors as padded obstacle tensors: vehicles first, then (the ego,) pedestrians, (statics)."""
        p_half = torch.full_like(s.ped.xy, agents.PEDESTRIAN_HALF)
        p_speed = torch.where(s.ped.moving, s.ped.speed, torch.zeros_like(s.ped.speed))
        parts = [(s.veh.xy, s.veh.yaw, s.veh.speed, s.veh.half, s.veh.valid)]
        if include_ego:
            parts.append((s.ego_xy.unsqueeze(1), s.ego_yaw.unsqueeze(1), s.ego_speed.unsqueeze(1),
                          self.ego_half.unsqueeze(1), torch.ones_like(s.ego_speed, dtype=torch.bool).unsqueeze(1)))
        parts.append((s.ped.xy, s.ped.yaw, p_speed, p_half, s.ped.valid))
        if include_statics:
            parts.append((s.statics.xy, s.statics.yaw, torch.zeros_like(s.statics.yaw), s.statics.half,
                          s.statics.valid))
        return tuple(torch.cat(x, 1) for x in zip(*parts))

    def _stop_lines(self, s: SimState, old_idx: Tensor, new_idx: Tensor) -> tuple[Tensor, Tensor]:
        """Red-light and stop-sign runs: the ego's tail passes a stop line on its route (CaRL §1.4).

        The tail is ``half length`` behind the centre, so the line counts as passed when the route index moves past
        the line's point plus that distance (1 m route spacing).
        """
        w = self.world
        stop, ev_idx, _ = upcoming_stop_lines(w, s.route_id, old_idx)
        tail = int(round(self.cfg.ego_half_extent[0]))
        line = ev_idx + tail
        crossed = (old_idx.unsqueeze(1) < line) & (new_idx.unsqueeze(1) >= line) & (w.route_ev_stop[s.route_id] >= 0)
        is_sign = w.stop_control[stop] == 2
        group = torch.where(is_sign, torch.full_like(stop, -1), w.stop_group[stop])
        state, _ = self.lights.state(s, group)
        red = (crossed & ~is_sign & (state == 2)).any(1)
        # stop signs: the ego must have stood still within the last 4 m before the line
        near_line = ((ev_idx - new_idx.unsqueeze(1)) <= 4) & ((ev_idx - new_idx.unsqueeze(1)) >= -tail) & is_sign
        s.stop_done = s.stop_done | ((near_line.any(1)) & (s.ego_speed < 0.1))
        ran_sign = (crossed & is_sign).any(1) & ~s.stop_done
        s.stop_done = s.stop_done & ~(crossed & is_sign).any(1)
        return red, ran_sign

    def _remove_hit_actors(self, s: SimState, overlaps: dict[str, Tensor], hit: Tensor) -> None:
        """Actors overlapping the ego leave the world once the collision is judged: the simulator has no contact
        physics, so they would otherwise stay glued to the ego (vehicles are respawned elsewhere later)."""
        for name, group in (("vehicle", s.veh), ("pedestrian", s.ped), ("static", s.statics)):
            group.valid = group.valid & ~(overlaps[name] & hit.unsqueeze(1))

    def _episode_info(self, s: SimState, done: Tensor, hard_t: Tensor, truncated: Tensor) -> dict[str, Tensor]:
        """Episode statistics of every row; ``hard_t`` are the events that ended the episode this step."""
        w = self.world
        route_len = w.route_len[s.route_id]
        outside_pct = s.outside_m / route_len.clamp(min=1e-3) * 100.0
        score = infractions.infraction_score(s.counts, outside_pct) * s.crit.ms_factor
        reason = torch.cat((hard_t, truncated.unsqueeze(-1)), -1)
        first = reason.float().argmax(-1)  # the first reason in TERMINATIONS order
        info = {
            "done": done,
            # copies: finished rows are reset in place right after
            "episode/return": s.ep_return.clone(), "episode/length": s.steps.float(), "episode/route_completion": s.rc.clone(),
            "episode/infraction_score": score, "episode/driving_score": (s.rc * score).clamp(min=0.0),
            "episode/km": route_len * s.rc / 100.0 / 1000.0, "episode/route_id": s.route_id.clone(),
            "episode/outside_lanes_pct": outside_pct, "episode/min_speed_factor": s.crit.ms_factor.clone(),
        }
        for i, name in enumerate(INFRACTIONS):
            info[f"episode/infractions/{name}"] = s.counts[:, i].float()
        info["episode/infractions/min_speed"] = s.crit.ms_events.float()
        for i, name in enumerate(TERMINATIONS):
            info[f"episode/termination/{name}"] = ((first == i) & reason.any(-1)).float()
        for hook in self.hooks:
            info.update(hook.episode_info(s, done, hard_t, truncated))
        return info

    def _observe(self, s: SimState, speed_limit: Tensor | None = None) -> dict[str, Tensor]:
        return self.observer.observe(s, speed_limit)

    def running_episodes(self) -> dict[str, Tensor]:
        """``episode/...`` statistics of every row's episode as it stands now (evaluation reports routes still
        running at its step limit instead of dropping them)."""
        if self.state is None:
            raise RuntimeError("call reset() before running_episodes()")
        none = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return self._episode_info(self.state, none, torch.zeros(self.num_envs, len(HARD), dtype=torch.bool,
                                                                device=self.device), none)

    @property
    def max_episode_steps(self) -> int:
        """Steps after which every episode has ended by the rules: CaRL's ``max_time``, or under Leaderboard rules the
        longest route's timeout at its lowest speed limit (300 s + length / (10 % of the limit))."""
        if self.cfg.rules == "leaderboard":
            w = self.world
            slowest = w.lane_speed[w.route_lane].min().clamp(min=0.1)
            seconds = criteria.ROUTE_TIMEOUT_BASE + float(w.route_len.max() / (
                criteria.ROUTE_TIMEOUT_SPEED_FRACTION * slowest))
        else:
            seconds = self.cfg.max_time
        return math.ceil(seconds / self.cfg.dt) + 10

    # ------------------------------------------------------------------ resume support
    def state_dict(self) -> dict:
        return {"seed": self.seed, "generator": self.gen.get_state(), "next_route": self.next_route.cpu()}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        self.gen.set_state(state["generator"])
        self.next_route = state["next_route"].to(self.device)

    @property
    def route_names(self) -> list[str]:
        return self.world.route_names

    @property
    def route_lengths(self) -> list[float]:
        """Length in metres of every route of the world, by route id."""
        return self.world.route_len.tolist()

