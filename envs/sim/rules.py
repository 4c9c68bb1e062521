"""The rules part: where the ego stands on its route, which infractions it commits, and which episodes end.

Two rule sets (``SimConfig.rules``, :mod:`envs.sim.criteria`):

* :class:`Rules` -- CaRL's training rules (``carl-reference.md`` §1.4): every hard infraction ends the episode
  (``ending_events`` may narrow that), the blocked timer and ``max_time`` are the config's;
* :class:`LeaderboardRules` -- Leaderboard 2.0's (``benchmarks.md`` Part A): collisions, red lights, stop signs and
  off-road excursions are recorded and the route goes on; route deviation, being blocked (180 s) and the route
  timeout end it; min-speed is scored at 4 checkpoints; a route done beyond 99 % within 10 m of its end counts 100 %.

A step asks the rules twice: :meth:`Rules.track` (route progress, stop lines, the blocked timer, the comfort history:
the bookkeeping any moved state needs, also the Leaderboard agent's mirror) and :meth:`Rules.judge` (infractions and
episode ends). Backends add their own ends as inputs (``episode_end``: a logged scenario's last frame;
``aborted``: a CARLA server lost mid-episode), not by overriding anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from envs.reward import comfort_violations
from envs.sim import criteria, infractions
from envs.sim.agents import PEDESTRIAN_HALF
from envs.sim.infractions import HARD
from envs.sim.observation import upcoming_stop_lines
from envs.sim.parts import Part
from envs.sim.state import SimState, obstacles
from envs.sim.world import LightFn

EndRule = Callable[[SimState], Tensor]  # a state -> rows [B] bool


@dataclass
class Tracking:
    """Where the ego got to this step: ``progress`` (route completion % gained), ``travelled`` (route metres),
    ``completed`` (the route counts as done), ``red_light`` and ``stop_sign`` (lines run this step)."""

    progress: Tensor
    travelled: Tensor
    completed: Tensor
    red_light: Tensor
    stop_sign: Tensor


@dataclass
class Judgement:
    """The rules' verdict on a step: the hard events counted (``hard`` [B, len(HARD)]), those that end the episode
    (``ending``), the soft events (speeding, ttc, comfort, outside; ``comfort`` per term), the lane the ego is on
    and how the episode ends. ``aborted``: episodes cut for no driving reason (they get no termination reason)."""

    tracking: Tracking
    lane: dict[str, Tensor]
    outside: Tensor
    hard: Tensor
    ending: Tensor
    ttc: Tensor
    comfort: Tensor
    terminated: Tensor
    truncated: Tensor
    aborted: Tensor

    def end_more(self, ends: Tensor) -> None:
        """A reward's own hard constraints end more episodes (terminations)."""
        self.terminated = self.terminated | ends
        self.truncated = self.truncated & ~self.terminated


class Rules(Part):
    """CaRL's training rules; the base of every rule set (see the module docstring)."""

    name = "carl"

    def __init__(self, ending_events: tuple[str, ...] = HARD, check_stop_lines: bool = True,
                 episode_end: EndRule | None = None, aborted: EndRule | None = None):
        unknown = set(ending_events) - set(HARD)
        if unknown:
            raise ValueError(f"ending_events: unknown {sorted(unknown)}; use names of {HARD}")
        self.ending_events = tuple(ending_events)
        self.check_stop_lines = check_stop_lines
        self.episode_end, self.aborted = episode_end, aborted

    def bind(self, setup) -> None:  # noqa: ANN001 - Setup
        super().bind(setup)
        self.ending_mask = torch.tensor([k in self.ending_events for k in HARD], device=setup.device)
        self.blocked_speed, self.blocked_time = setup.cfg.blocked_speed, setup.cfg.blocked_time

    # ------------------------------------------------------------------ tracking
    def track(self, s: SimState, lights: LightFn) -> Tracking:
        """Advance the route bookkeeping of a state that has moved (clock already advanced)."""
        w, cfg = self.setup.world, self.setup.cfg
        new_idx = infractions.route_progress(w, s.route_id, s.route_idx, s.ego_xy)
        if self.check_stop_lines:
            red, sign = stop_lines(w, s, s.route_idx, new_idx, lights, cfg.ego_half_extent[0])
        else:
            red = torch.zeros_like(s.stop_done)
            sign = red.clone()
        rc, completed = self.completion(s, infractions.route_completion(w, s.route_id, new_idx))
        progress = rc - s.rc
        travelled = w.route_cum[s.route_id, new_idx] - w.route_cum[s.route_id, s.route_idx]
        s.route_idx, s.rc = new_idx, rc
        s.still_time = torch.where(s.ego_speed < self.blocked_speed, s.still_time + cfg.dt, torch.zeros_like(s.t))
        s.hist_speed = torch.cat((s.hist_speed[:, 1:], s.ego_speed.unsqueeze(1)), 1)
        s.hist_yaw = torch.cat((s.hist_yaw[:, 1:], s.ego_yaw.unsqueeze(1)), 1)
        return Tracking(progress, travelled, completed, red, sign)

    def completion(self, s: SimState, rc: Tensor) -> tuple[Tensor, Tensor]:
        """Route completion % and whether the route counts as done by it (never, under CaRL's rules: the route's
        end is reached by index)."""
        return rc, torch.zeros_like(rc, dtype=torch.bool)

    # ------------------------------------------------------------------ judging
    def judge(self, s: SimState, tr: Tracking) -> Judgement:
        """Infractions and episode ends of a tracked state."""
        w, cfg, c = self.setup.world, self.setup.cfg, s.crit
        deviated, c.dev_idx, c.out_route_m = infractions.route_deviation(
            w, s.route_id, c.dev_idx, s.ego_xy, c.out_route_m, cfg.route_deviation_safe, cfg.route_deviation,
            cfg.route_deviation_fraction)
        lane, outside = self.lanes(s)
        hits = self.collisions(s)
        events = {
            "collision_vehicle": hits["vehicle"], "collision_pedestrian": hits["pedestrian"],
            "collision_static": hits["static"], "red_light": tr.red_light, "stop_sign": tr.stop_sign,
            "off_road": infractions.off_road(w, s.ego_xy, s.ego_yaw, self.setup.ego_half, cfg.off_road_fraction),
            "route_deviation": deviated,
            "blocked": s.still_time > self.blocked_time + 1e-3,  # "more than": robust to the sum of dt in float32
            "timeout": self.timeout(s, tr, lane),
        }
        hard = torch.stack([events[k] for k in HARD], -1)
        hard, ending, terminated, truncated = self.ends(s, tr, hard)
        truncated, aborted = self.backend_ends(s, terminated, truncated)
        ttc, comfort = self.soft(s)
        return Judgement(tr, lane, outside, hard, ending, ttc, comfort, terminated, truncated, aborted)

    def lanes(self, s: SimState) -> tuple[dict[str, Tensor], Tensor]:
        """The lane the ego is on, and whether it is outside the lanes (off them or driving the wrong way)."""
        c = s.crit
        lane = infractions.lane_measures(self.setup.world, s.ego_xy, s.ego_yaw)
        c.wrong_way = infractions.wrong_way(lane, s.ego_yaw, c.prev_lane, c.prev_lane_yaw, c.prev_junction,
                                            c.wrong_way)
        c.prev_lane = torch.where(lane["found"], lane["lane"], c.prev_lane)
        c.prev_lane_yaw = torch.where(lane["found"], lane["lane_yaw"], c.prev_lane_yaw)
        c.prev_junction = torch.where(lane["found"], lane["junction"], c.prev_junction)
        return lane, lane["off_lane"] | c.wrong_way

    def overlaps(self, s: SimState) -> dict[str, Tensor]:
        """[B, N] overlaps of the ego with every vehicle, pedestrian and static object."""
        return infractions.collisions(s.ego_xy, s.ego_yaw, self.setup.ego_half, {
            "vehicle": (s.veh.xy, s.veh.yaw, s.veh.half, s.veh.valid),
            "pedestrian": (s.ped.xy, s.ped.yaw, torch.full_like(s.ped.xy, PEDESTRIAN_HALF), s.ped.valid),
            "static": (s.statics.xy, s.statics.yaw, s.statics.half, s.statics.valid)})

    def collisions(self, s: SimState) -> dict[str, Tensor]:
        """Collision events [B] per actor class: any overlap ends the episode anyway."""
        return {name: hit.any(1) for name, hit in self.overlaps(s).items()}

    def timeout(self, s: SimState, tr: Tracking, lane: dict[str, Tensor]) -> Tensor:
        return s.t > self.setup.cfg.max_time

    def ends(self, s: SimState, tr: Tracking, hard: Tensor) -> tuple[Tensor, ...]:
        """(hard events counted, events ending the episode, terminated, truncated): every ending event ends it; the
        route's second-to-last point truncates it."""
        w = self.setup.world
        ending = hard & self.ending_mask
        terminated = ending.any(-1)
        truncated = (s.route_idx >= w.route_n[s.route_id] - 2) & ~terminated
        return hard, ending, terminated, truncated

    def backend_ends(self, s: SimState, terminated: Tensor, truncated: Tensor) -> tuple[Tensor, Tensor]:
        """The backend's own ends (truncations): ``episode_end``, then ``aborted`` for rows not ending anyway."""
        if self.episode_end is not None:
            truncated = truncated | (self.episode_end(s) & ~terminated)
        aborted = torch.zeros_like(truncated)
        if self.aborted is not None:
            aborted = self.aborted(s) & ~(terminated | truncated)
        return truncated | aborted, aborted

    def soft(self, s: SimState) -> tuple[Tensor, Tensor]:
        """CaRL's soft penalties' events: a time-to-collision violation and the comfort terms out of bounds."""
        cfg, half = self.setup.cfg, self.setup.ego_half
        a_xy, a_yaw, a_speed, a_half, a_valid = obstacles(s, half, include_ego=False)
        ttc = infractions.ttc_violation(s.ego_xy, s.ego_yaw, s.ego_speed, half, a_xy, a_yaw, a_speed, a_half,
                                        a_valid, cfg.reward.ttc_times)
        comfort = comfort_violations(*infractions.comfort_metrics(s.hist_speed, s.hist_yaw, s.steps, cfg.dt),
                                     cfg.reward)
        return ttc, comfort

    def max_seconds(self) -> float:
        """Seconds after which every episode has ended by these rules."""
        return self.setup.cfg.max_time


class LeaderboardRules(Rules):
    """Leaderboard 2.0's evaluation rules (see the module docstring and :mod:`envs.sim.criteria`)."""

    name = "leaderboard"
    ROUTE_ENDING = ("route_deviation", "blocked", "timeout")

    def __init__(self, check_stop_lines: bool = True, episode_end: EndRule | None = None,
                 aborted: EndRule | None = None):
        super().__init__(self.ROUTE_ENDING, check_stop_lines, episode_end, aborted)

    def bind(self, setup) -> None:  # noqa: ANN001 - Setup
        super().bind(setup)
        self.blocked_speed, self.blocked_time = criteria.LB_BLOCKED_SPEED, criteria.LB_BLOCKED_TIME

    def completion(self, s: SimState, rc: Tensor) -> tuple[Tensor, Tensor]:
        """RouteCompletionTest's success: beyond 99 % and within 10 m of the end counts as 100 %."""
        w = self.setup.world
        end = w.route_pts[s.route_id, w.route_n[s.route_id] - 1]
        completed = (rc > criteria.COMPLETED_RC) & ((s.ego_xy - end).norm(dim=-1) < criteria.COMPLETED_END_DIST)
        return torch.where(completed, torch.full_like(rc, 100.0), rc), completed

    def collisions(self, s: SimState) -> dict[str, Tensor]:
        """CollisionTest's merging; the hit actor leaves the world (no contact physics here: it would stay glued to
        the ego; vehicles are respawned elsewhere later)."""
        overlaps = self.overlaps(s)
        hit_class, hit_key = criteria.first_hit(overlaps)
        recorded = criteria.record_collisions(s.crit, hit_class, hit_key, s.ego_xy, s.ego_speed, s.t)
        hit = hit_class >= 0
        for name, group in (("vehicle", s.veh), ("pedestrian", s.ped), ("static", s.statics)):
            group.valid = group.valid & ~(overlaps[name] & hit.unsqueeze(1))
        return {name: recorded & (hit_class == i) for i, name in enumerate(criteria.ACTOR_CLASSES)}

    def timeout(self, s: SimState, tr: Tracking, lane: dict[str, Tensor]) -> Tensor:
        criteria.extend_timeout(s.crit, tr.travelled, lane["speed_limit"])
        return s.t > s.crit.timeout

    def ends(self, s: SimState, tr: Tracking, hard: Tensor) -> tuple[Tensor, ...]:
        """Off-road counts once per excursion; only the route-ending events end the route, which is truncated when
        completed or at its last point; min-speed checkpoints are scored as the route goes and when it ends."""
        w, c = self.setup.world, s.crit
        i = HARD.index("off_road")
        off_road_now = hard[:, i].clone()
        hard[:, i] = off_road_now & ~c.off_road
        c.off_road = off_road_now
        ending = hard & self.ending_mask
        terminated = ending.any(-1)
        truncated = (tr.completed | (s.route_idx >= w.route_n[s.route_id] - 1)) & ~terminated
        bg = self.setup.background_vehicles  # background traffic only, not scenario actors
        traffic_speed, has_traffic = criteria.background_speed(s.veh.speed[:, :bg], s.veh.valid[:, :bg])
        criteria.update_min_speed(c, w.route_cum[s.route_id, s.route_idx], w.route_len[s.route_id], s.ego_speed,
                                  traffic_speed, has_traffic, terminated | truncated)
        return hard, ending, terminated, truncated

    def max_seconds(self) -> float:
        """The longest route's timeout at its lowest speed limit (300 s + length / (10 % of the limit))."""
        w = self.setup.world
        slowest = w.lane_speed[w.route_lane].min().clamp(min=0.1)
        return criteria.ROUTE_TIMEOUT_BASE + float(w.route_len.max() / (
            criteria.ROUTE_TIMEOUT_SPEED_FRACTION * slowest))


RULE_SETS = {"carl": Rules, "leaderboard": LeaderboardRules}


def stop_lines(w, s: SimState, old_idx: Tensor, new_idx: Tensor, lights: LightFn, tail_m: float  # noqa: ANN001
               ) -> tuple[Tensor, Tensor]:
    """Red-light and stop-sign runs: the ego's tail passes a stop line on its route (CaRL §1.4).

    The tail is ``tail_m`` (half the ego's length) behind the centre, so the line counts as passed when the route
    index moves past the line's point plus that distance (1 m route spacing). Updates ``s.stop_done``.
    """
    stop, ev_idx, _ = upcoming_stop_lines(w, s.route_id, old_idx)
    tail = int(round(tail_m))
    line = ev_idx + tail
    crossed = (old_idx.unsqueeze(1) < line) & (new_idx.unsqueeze(1) >= line) & (w.route_ev_stop[s.route_id] >= 0)
    is_sign = w.stop_control[stop] == 2
    group = torch.where(is_sign, torch.full_like(stop, -1), w.stop_group[stop])
    state, _ = lights(group)
    red = (crossed & ~is_sign & (state == 2)).any(1)
    # stop signs: the ego must have stood still within the last 4 m before the line
    near_line = ((ev_idx - new_idx.unsqueeze(1)) <= 4) & ((ev_idx - new_idx.unsqueeze(1)) >= -tail) & is_sign
    s.stop_done = s.stop_done | ((near_line.any(1)) & (s.ego_speed < 0.1))
    ran_sign = (crossed & is_sign).any(1) & ~s.stop_done
    s.stop_done = s.stop_done & ~(crossed & is_sign).any(1)
    return red, ran_sign
