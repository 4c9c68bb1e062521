"""Rule-based expert on privileged simulator state: a baseline policy and the proof that routes are drivable.

Lateral: pure pursuit on the dense route. Longitudinal: IDM towards the speed limit (slower in turns), treating as
obstacles every actor near the route path ahead (pedestrians also at their position 1.5 s ahead), red and yellow
lights, and stop signs until it has stopped. Batched like the simulator: one call drives every environment.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from envs.sim import agents, infractions
from envs.sim.dynamics import DRAG, ROLLING
from envs.sim.geometry import boxes_overlap, to_local, wrap_angle
from envs.sim.observation import upcoming_stop_lines
from envs.sim.state import obstacles

if TYPE_CHECKING:  # the env is what these read, not a dependency of theirs
    from envs.sim.env import SimEnv

PATH_POINTS = 24  # path samples ahead for obstacles (every 2 m)
FORECAST_POINTS = 40  # path samples ahead for the forecast (80 m: a launch covers ~60 m in its horizon)
PATH_STEP = 2
TURN_SPEED = 5.5  # m/s through sharp turns
FORECAST = torch.arange(0.0, 6.01, 0.25)  # s: the times at which moving actors and the ego's own progress are compared
CRUISE_HORIZON = 4.0  # s: how far ahead driving on as usual is checked
EGO_ACCEL = 2.0  # m/s^2: how the ego is assumed to speed up when it goes on as usual
LAUNCH_SPEED = 20.0  # m/s: a launch speeds up to the stream it joins (the junction flows drive 20 m/s)
HOLD_BACK = 8.0  # m: short of a fast stream's sweep the ego waits this far back, room to launch into a gap
RUN_UP = 15.0  # m: short of a fast stream it merges into, room to be at speed when it joins
FAST = 10.0  # m/s: a stream this fast is waited for from HOLD_BACK
LINE_ROOM = 30.0  # m: a launch needs the next line it must stop at at least this far ahead
MARGIN = (1.0, 0.3)  # m: added to the ego's half length and half width where it is forecast to meet actors
CAR_HALF = (2.4, 1.0)  # m: a flow's unseen next car (half length, half width)


class Expert:
    """``Expert(env)(obs) -> actions [B, 2]``; reads ``env.state`` (privileged), ignores ``obs``."""

    def __init__(self, env: SimEnv, speed_fraction: float = 0.9, unseen_flow_cars: bool = True):
        """``unseen_flow_cars``: whether it yields to the junction flows' next cars before they spawn (privileged: no
        observation shows them); without it (``expert_seen``, a teacher whose labels the policy's inputs can explain)
        it yields only to the cars that exist."""
        self.env = env
        self.speed_fraction = speed_fraction
        self.unseen_flow_cars = unseen_flow_cars

    def __call__(self, obs: dict[str, Tensor] | None = None) -> Tensor:
        env, cfg = self.env, self.env.cfg
        s = env.state
        v = s.ego_speed
        v0 = self.target_speed(s)
        gap, lead_v, yielding, launch = self.obstacle_gap(s, v0)
        # traffic control: a line to stop at, if it comes before the obstacle, stops the ego there
        line_gap = self.stop_line_gap(s)
        stop_first = line_gap < gap
        launch &= line_gap > LINE_ROOM  # a launch never runs a light
        gap = torch.minimum(gap, line_gap)
        lead_v = torch.where(stop_first, torch.zeros_like(lead_v), lead_v)
        # beside scenario vehicles (after a launch) over-speed is shed gently, as the forecast assumes; else plain IDM
        gentle = s.veh.valid[:, env.setup.background_vehicles:].any(-1)
        acc = self.accel(v, v0, gap.clamp(min=0.05), v - lead_v, gentle)
        # a launch speeds up as its forecast assumed, still following the car ahead
        follow = agents.idm_accel(v, torch.full_like(v, LAUNCH_SPEED), gap.clamp(min=0.05), v - lead_v)
        drag = DRAG * v * v + ROLLING * (v > 0).float()  # the ego model's resistance, made up for by throttle
        lon = torch.where(acc + drag >= 0, (acc + drag) / cfg.max_accel, acc / cfg.max_brake)
        full = torch.where(v < LAUNCH_SPEED, torch.ones_like(lon), drag / cfg.max_accel)
        lon = torch.where(launch, torch.where(follow < 0, follow / cfg.max_brake, full), lon)
        # hold still at a standstill when the way is not clear
        # (short of a stream it yields to: no creeping towards it)
        lon = torch.where(((gap < 1.0) | (yielding & (gap < 6.0))) & (v < 0.5), torch.full_like(lon, -1.0), lon)
        return torch.stack((self.steer(s), lon.clamp(-1.0, 1.0)), -1)

    @staticmethod
    def accel(v: Tensor, v0: Tensor, gap: Tensor, dv: Tensor, gentle: Tensor) -> Tensor:
        """IDM towards ``v0``; where ``gentle`` and above ``v0`` (after a launch) slowing by at most
        :data:`EGO_ACCEL` for the speed alone, as the forecast assumes, and harder only for an obstacle."""
        over = gentle & (v > v0)
        acc = agents.idm_accel(v, torch.where(over, v, v0), gap, dv)  # above v0: no free-road term
        free = (agents.IDM_ACCEL * (1.0 - (v / v0.clamp(min=0.1)) ** 4)).clamp(min=-EGO_ACCEL)
        return torch.where(over, (acc + free).clamp(min=-8.0), acc)

    def steer(self, s) -> Tensor:  # noqa: ANN001 - SimState
        """Pure pursuit on the dense route, looking further ahead the faster the ego drives."""
        w, cfg = self.env.world, self.env.cfg
        n = w.route_n[s.route_id]
        look = (2.5 + 0.6 * s.ego_speed).clamp(4.0, 14.0)
        k = (s.route_idx + look.round().long()).clamp(max=n - 1)
        local = to_local(w.route_pts[s.route_id, k], s.ego_xy, s.ego_yaw)
        ld = local.norm(dim=-1).clamp(min=1.0)
        alpha = torch.atan2(local[:, 1], local[:, 0])
        delta = torch.atan(2.0 * cfg.wheelbase * torch.sin(alpha) / ld)
        return (delta / cfg.max_steer).clamp(-1.0, 1.0)

    def target_speed(self, s) -> Tensor:  # noqa: ANN001 - SimState
        """A fraction of the speed limit, at most :data:`TURN_SPEED` where the route turns within ~24 m."""
        w = self.env.world
        n = w.route_n[s.route_id]
        limit = infractions.lane_measures(w, s.ego_xy, s.ego_yaw)["speed_limit"]
        p10 = w.route_pts[s.route_id, (s.route_idx + 12).clamp(max=n - 1)]
        p20 = w.route_pts[s.route_id, (s.route_idx + 24).clamp(max=n - 1)]
        h1 = torch.atan2((p10 - s.ego_xy)[:, 1], (p10 - s.ego_xy)[:, 0])
        h2 = torch.atan2((p20 - p10)[:, 1], (p20 - p10)[:, 0])
        turning = (wrap_angle(h2 - h1).abs() > 0.35) | (wrap_angle(h1 - s.ego_yaw).abs() > 0.35)
        v0 = limit * self.speed_fraction
        return torch.where(turning, v0.clamp(max=TURN_SPEED), v0)

    def obstacle_gap(self, s, v0: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # noqa: ANN001 - SimState
        """(gap to the first actor on or crossing the path ahead, now or in 1.5 s, or to where the ego yields to a
        stream (:meth:`forecast`); its speed along the ego's heading; whether the gap is a yield; whether to launch
        into a gap instead); no such actor: a gap of ~1 km and the target speed ``v0``."""
        env, w = self.env, self.env.world
        B, dev = env.num_envs, env.device
        n = w.route_n[s.route_id]
        j = s.route_idx.unsqueeze(1) + PATH_STEP * torch.arange(1, FORECAST_POINTS + 1, device=dev)
        j = torch.minimum(j, (n - 1).unsqueeze(1))
        rid = s.route_id.unsqueeze(1).expand_as(j)
        long_path = w.route_pts[rid, j]  # [B,K',2]
        long_along = w.route_cum[rid, j] - w.route_cum[s.route_id, s.route_idx].unsqueeze(1)
        path, dist_along = long_path[:, :PATH_POINTS], long_along[:, :PATH_POINTS]
        a_xy, a_yaw, a_speed, a_half, a_valid = obstacles(s, env.ego_half, include_ego=False)
        a_dir = torch.stack((torch.cos(a_yaw), torch.sin(a_yaw)), -1)
        future = a_xy + a_dir * (a_speed * 1.5).unsqueeze(-1)
        clearance = env.ego_half[:, 1:2] + a_half[..., 1] + 1.0  # [B,N]
        # only the valid actors ahead (what is behind the ego is ignored; its own route behind is not on the path
        # anyway): their (row, actor) pairs, one host sync
        b, n = (a_valid & (to_local(a_xy, s.ego_xy.unsqueeze(1), s.ego_yaw.unsqueeze(1))[..., 0] > 0)).nonzero(
            as_tuple=True)
        d_now = (path[b] - a_xy[b, n].unsqueeze(1)).norm(dim=-1)  # [P,K]
        d_fut = (path[b] - future[b, n].unsqueeze(1)).norm(dim=-1)
        blocked = (d_now < clearance[b, n].unsqueeze(1)) | (d_fut < clearance[b, n].unsqueeze(1))
        # gap acceptance: a moving actor that would be where the ego would be, at the same time within the forecast,
        # if the ego went on (crossing and merging streams), holds the ego before the first path point it sweeps,
        # unless a launch into the gap meets nobody; a launch then minds only what the forecast did not check
        N, n_veh = a_xy.shape[1], s.veh.xy.shape[1]
        idx = torch.arange(N, device=dev)
        reckless = (idx >= env.setup.background_vehicles) & (idx < n_veh)  # they ignore the ego
        u_xy, u_yaw, u_speed, u_valid, scripted = self.scenario_knowledge(s)
        u_dir = torch.stack((torch.cos(u_yaw), torch.sin(u_yaw)), -1)
        U = u_xy.shape[1]
        yield_gap, launch, forecast = self.forecast(
            s, v0, long_path, long_along, torch.cat((a_xy, u_xy), 1), torch.cat((a_dir, u_dir), 1),
            torch.cat((a_speed, u_speed), 1), torch.cat((a_half, torch.tensor(CAR_HALF, device=dev).expand(B, U, 2)), 1),
            torch.cat((a_valid, u_valid), 1), torch.cat((a_yaw, u_yaw), 1),
            torch.cat((reckless, torch.ones(U, dtype=torch.bool, device=dev))),
            scripted)
        blocked &= ~(launch[b] & forecast[b, n]).unsqueeze(1)
        first_obs = torch.full((B, dist_along.shape[1], N), 1e3, device=dev)  # [B,K,N]
        first_obs[b, :, n] = torch.where(blocked, d_now, torch.full_like(d_now, 1e3))
        any_k = torch.zeros(B, dist_along.shape[1], dtype=torch.long, device=dev).index_put_(
            (b,), blocked.long(), accumulate=True) > 0  # [B,K]: some actor blocks path point k
        gap_k = torch.where(any_k, dist_along, torch.full_like(dist_along, 1e3))
        gap, kk = gap_k.min(1)
        lead = torch.gather(first_obs, 1, kk.view(B, 1, 1).expand(B, 1, first_obs.shape[2])).squeeze(1).argmin(-1)
        lead_v = (a_speed * torch.cos(a_yaw - s.ego_yaw.unsqueeze(1))).gather(1, lead.unsqueeze(1)).squeeze(1)
        gap = gap - env.ego_half[:, 0] - 1.0
        stop_first = yield_gap < gap
        gap = torch.minimum(gap, yield_gap)
        lead_v = torch.where(stop_first, torch.zeros_like(lead_v), lead_v)
        return gap, torch.where(gap < 500, lead_v.clamp(min=0.0), v0), stop_first, launch

    def scenario_knowledge(self, s) -> tuple[Tensor, ...]:  # noqa: ANN001 - SimState
        """What the expert knows of the route scenarios (privileged, as PDM-Lite's scenario knowledge): each flow's
        next two cars, not yet spawned (xy [B,U,2], yaw, speed, valid [B,U]) and where the scenario vehicles
        will be on their scripted paths at the :data:`FORECAST` times (xy [B,V,T,2], yaw, gone [B,V,T]; None
        without route scenarios). Without ``unseen_flow_cars`` the next cars are all invalid."""
        scenarios = getattr(self.env, "scenarios", None)
        if scenarios is None or not scenarios.on:
            B, dev = self.env.num_envs, self.env.device
            return (torch.zeros(B, 0, 2, device=dev), torch.zeros(B, 0, device=dev), torch.zeros(B, 0, device=dev),
                    torch.zeros(B, 0, dtype=torch.bool, device=dev), None)
        xy, yaw, speed, valid = (x.flatten(1, 2) for x in scenarios.next_flow_cars(s))
        forecast = scenarios.vehicle_forecast(s, FORECAST.to(self.env.device))
        return xy, yaw, speed, valid & self.unseen_flow_cars, forecast

    def forecast(self, s, v0: Tensor, path: Tensor, dist_along: Tensor, a_xy: Tensor, a_dir: Tensor,  # noqa: ANN001
                 a_speed: Tensor, a_half: Tensor, a_valid: Tensor, a_yaw: Tensor, reckless: Tensor,
                 scripted: tuple[Tensor, Tensor, Tensor] | None = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """(distance to stop at before a moving actor's sweep when, driving on as usual, the ego would meet it, ~1 km
        when none; whether a launch, full throttle up to :data:`LAUNCH_SPEED`, meets nobody instead; the actors
        the forecast checked [B,N]).

        Both are checked over :data:`CRUISE_HORIZON`, the scenario actors, which do not adapt to the ego, over the
        whole :data:`FORECAST`; actors move at constant velocity, the scenario vehicles along their scripted paths.
        Followers (behind, driving the ego's way) are not yielded to, but the scenario actors (``reckless`` [N]:
        they ignore the ego) count for a launch: one that would rear-end the ego is outrun or not joined. Sweeps the
        ego is already in with its centre (it is committed) are not yielded to. The ego waits with its nose 2 m short
        of a slow actor's sweep and :data:`HOLD_BACK` short of a fast stream's. Only the scenario vehicles are
        launched past (never pedestrians, never the background traffic, which yields)."""
        env = self.env
        taus = FORECAST.to(s.ego_speed.device)
        v = s.ego_speed.unsqueeze(1)
        cruise = _travel(v, v0.unsqueeze(1), EGO_ACCEL, taus)  # [B,T]
        rush = _full_throttle(v, env.cfg.max_accel - ROLLING, taus)
        actor_at, actor_yaw = _actor_forecast(a_xy, a_dir, a_speed, a_yaw, taus, scripted,
                                              env.setup.background_vehicles)
        in_cruise = taus <= CRUISE_HORIZON
        ego_he = (env.ego_half + torch.tensor(MARGIN, device=env.device)).view(-1, 1, 1, 2)
        path_yaw = _headings(path)

        local = to_local(a_xy, s.ego_xy.unsqueeze(1), s.ego_yaw.unsqueeze(1))
        follower = (local[..., 0] < 0) & (torch.cos(a_yaw - s.ego_yaw.unsqueeze(1)) > 0.8)
        counted = a_valid & (~follower | reckless)  # standing ones too, for a launch
        considered = counted & (a_speed > 0.5)
        pairs = _Pairs.of(counted, actor_at, actor_yaw, a_half)
        track = lambda ego_d: _ego_track(path, path_yaw, dist_along, s.ego_xy, s.ego_yaw, ego_d)  # noqa: E731
        # scenario streams over the whole forecast: a gap too short for the turn is not started into
        within = in_cruise | reckless.unsqueeze(-1)  # [N,T]
        threat = pairs.meet(track(cruise), ego_he, within) & considered  # [B,N]
        # where to wait: the first path point a (non-following) threat sweeps within the cruise horizon
        clearance = env.ego_half[:, 1:2] + a_half[..., 1] + 1.0  # [B,N]
        # measured only where read below: the threats' sweeps and the fast scenario streams'
        read = considered & ~follower & (threat | (reckless & (a_speed > FAST)))
        sweeps = _sweeps(path, actor_at, clearance, within, read)  # [B,K,N]
        swept = sweeps & (threat & ~follower).unsqueeze(1)
        # into or across a fast scenario stream the ego goes only by a launch, so that the next car, which may
        # appear at the stream's source any time, finds it already through
        stream = (sweeps.any(1) & considered & ~follower & reckless & (a_speed > FAST)).any(-1)
        only_scenario = ~(threat & ~reckless).any(-1)  # never launched past pedestrians or the background traffic
        rushed = pairs.meet(track(rush), ego_he, within) & counted
        launch = (threat.any(-1) | stream) & only_scenario & ~rushed.any(-1)
        first = torch.where(swept.any(-1), dist_along, torch.full_like(dist_along, 1e3)).min(1).values
        back, fast = _wait_back(swept, a_speed, a_yaw, path_yaw)
        # no safe launch, but stopping would not help: a stream's car closing in from behind, or a fast stream's
        # sweep nearer than the ego can stop (hard braking, 6 m/s^2): full throttle is the least bad
        vs = s.ego_speed
        cannot_stop = fast & (first - env.ego_half[:, 0] < vs * vs / 12.0)
        from_behind = threat.any(-1) & ~(threat & ~follower).any(-1)
        launch |= (cannot_stop | from_behind) & only_scenario
        ignore = (first < 0.5) | (first >= 1e3) | launch  # committed, nothing to yield to, or launching
        return torch.where(ignore, torch.full_like(first, 1e3), first - env.ego_half[:, 0] - back), launch, considered

    def stop_line_gap(self, s) -> Tensor:  # noqa: ANN001 - SimState
        """Distance to aim at for the next stop line the ego must stop at (red, a yellow it can stop for, a stop
        sign not yet obeyed); ~1 km when none."""
        env, w = self.env, self.env.world
        stop, ev_idx, near = upcoming_stop_lines(w, s.route_id, s.route_idx)
        ahead = (ev_idx - s.route_idx.unsqueeze(1)).float()
        is_sign = w.stop_control[stop] == 2
        group = torch.where(is_sign, torch.full_like(stop, -1), w.stop_group[stop])
        state, _ = env.light_lookup(s)(group)
        to_line = ahead - env.ego_half[:, :1]  # nose to line
        can_stop = to_line > s.ego_speed.unsqueeze(1) ** 2 / (2 * 4.0) - 0.5
        must = near & (ahead > -1.0) & (((state == 2) | ((state == 1) & can_stop)) & ~is_sign
                                         | is_sign & ~s.stop_done.unsqueeze(1))
        # IDM halts ~2 m short of an obstacle: aim 1 m past the line point so the centre stops ~3 m before it
        return torch.where(must, (ahead - 1.0).clamp(min=0.0), torch.full_like(to_line, 1e3)).min(1).values


@dataclass
class _Pairs:
    """The (row, actor) pairs a meeting with the ego can matter for (the counted actors; every use is masked by them,
    and the others' forecasts are most of the [B, N, T] box tests), with their forecasts ([P, T, ...])."""

    b: Tensor
    n: Tensor
    at: Tensor
    yaw: Tensor
    half: Tensor
    shape: tuple[int, int]

    @classmethod
    def of(cls, counted: Tensor, actor_at: Tensor, actor_yaw: Tensor, a_half: Tensor) -> _Pairs:
        b, n = counted.nonzero(as_tuple=True)  # one host sync
        return cls(b, n, actor_at[b, n], actor_yaw[b, n], a_half[b, n].unsqueeze(1), tuple(counted.shape))

    def meet(self, track: tuple[Tensor, Tensor, Tensor], ego_he: Tensor, within: Tensor) -> Tensor:
        """[B,N]: whether the pair's actor meets the ego on ``track`` (:func:`_ego_track`) at a time ``within``
        [N,T] allows (False off the pairs)."""
        ego_at, ego_yaw, gone = track
        b, n = self.b, self.n
        close = boxes_overlap(ego_at[b], ego_yaw[b], ego_he[b, 0], self.at, self.yaw, self.half)  # [P,T]
        met = torch.zeros(self.shape, dtype=torch.bool, device=close.device)
        met[b, n] = (close & within[n] & ~gone[b]).any(-1)
        return met


def _sweeps(path: Tensor, actor_at: Tensor, clearance: Tensor, within: Tensor, considered: Tensor) -> Tensor:
    """[B,K,N]: whether actor n of the pairs to measure (``considered`` [B,N]; False for the others: no sweep) comes
    within ``clearance`` [B,N] of path point k ([B,K,2]) at a forecast time ``within`` ([N,T]) allows, its forecast
    ``actor_at`` [B,N,T,2]. Only the considered (row, actor) pairs are measured (one host sync), as the distances of
    all of them to every path point at every time are the expert's largest tensor."""
    B, K = path.shape[:2]
    b, n = considered.nonzero(as_tuple=True)  # [P]
    near = torch.cdist(path[b], actor_at[b, n], compute_mode="donot_use_mm_for_euclid_dist")  # [P,K,T]
    out = torch.zeros(B, K, considered.shape[1], dtype=torch.bool, device=path.device)
    out[b, :, n] = ((near < clearance[b, n][:, None, None]) & within[n].unsqueeze(1)).any(-1)  # [P,K]
    return out


def _wait_back(swept: Tensor, a_speed: Tensor, a_yaw: Tensor, path_yaw: Tensor) -> tuple[Tensor, Tensor]:
    """How far short of the first point a threat sweeps (``swept`` [B,K,N]) the ego waits [B]: 2 m for slow actors,
    :data:`HOLD_BACK` for a fast stream it crosses, :data:`RUN_UP` for one it merges into (the stream sweeps the
    path going the path's way: the ego joins it at speed); and whether the stream is fast [B]."""
    fast = swept.any(1) & (a_speed > FAST)  # [B,N]
    aligned = torch.cos(a_yaw.unsqueeze(1) - path_yaw.unsqueeze(2)) > 0.7  # [B,K,N]
    merge = ((swept & aligned).any(1) & fast).any(-1)
    back = torch.where(merge, RUN_UP, torch.where(fast.any(-1), HOLD_BACK, 2.0))
    return back, fast.any(-1)


def _travel(v: Tensor, target: Tensor, accel: float, taus: Tensor) -> Tensor:
    """Distance covered at times ``taus`` [T] from speed ``v`` [B,1], changing speed towards ``target`` [B,1] at
    ``accel`` (up or down) and holding it there: [B,T]."""
    dv = target - v
    tt = torch.minimum(taus, dv.abs() / accel)
    return v * tt + 0.5 * accel * torch.sign(dv) * tt ** 2 + target * (taus - tt)


def _full_throttle(v: Tensor, accel: float, taus: Tensor) -> Tensor:
    """Distance covered at times ``taus`` [T] from speed ``v`` [B,1] at full throttle (``accel`` less the ego
    model's quadratic drag: v(t) = V tanh(c t + phi)) up to :data:`LAUNCH_SPEED`, then holding it: [B,T]."""
    top, c = math.sqrt(accel / DRAG), math.sqrt(accel * DRAG)
    phi = torch.atanh((v / top).clamp(max=LAUNCH_SPEED / top))
    t_cap = ((math.atanh(LAUNCH_SPEED / top) - phi) / c).clamp(min=0.0)
    tt = torch.minimum(taus, t_cap)
    d = top / c * (torch.log(torch.cosh(c * tt + phi)) - torch.log(torch.cosh(phi)))
    return d + torch.maximum(v, torch.full_like(v, LAUNCH_SPEED)) * (taus - tt)


def _actor_forecast(a_xy: Tensor, a_dir: Tensor, a_speed: Tensor, a_yaw: Tensor, taus: Tensor,
                    scripted: tuple[Tensor, Tensor, Tensor] | None, first: int) -> tuple[Tensor, Tensor]:
    """Actors at times ``taus``: (xy [B,N,T,2], yaw [B,N,T]) at constant velocity, the scenario vehicles (slots from
    ``first`` on) along their scripted paths instead, far away once gone."""
    actor_at = a_xy.unsqueeze(2) + a_dir.unsqueeze(2) * (a_speed.unsqueeze(-1) * taus).unsqueeze(-1)
    actor_yaw = a_yaw.unsqueeze(-1).expand(-1, -1, len(taus))
    if scripted is None:
        return actor_at, actor_yaw
    sv_xy, sv_yaw, sv_gone = scripted
    end = first + sv_xy.shape[1]
    sv_xy = torch.where(sv_gone.unsqueeze(-1), torch.full_like(sv_xy, 1e4), sv_xy)
    return (torch.cat((actor_at[:, :first], sv_xy, actor_at[:, end:]), 1),
            torch.cat((actor_yaw[:, :first], sv_yaw, actor_yaw[:, end:]), 1))


def _ego_track(path: Tensor, path_yaw: Tensor, dist_along: Tensor, ego_xy: Tensor, ego_yaw: Tensor, ego_d: Tensor
               ) -> tuple[Tensor, Tensor, Tensor]:
    """The ego ``ego_d`` [B,T] metres along its path ``path`` [B,K,2] (headings ``path_yaw``, ``dist_along`` [B,K]):
    (xy [B,T,2], heading [B,T], past the path's end [B,T]: the route ends there, or the forecast knows no further)."""
    k = torch.searchsorted(dist_along.contiguous(), ego_d.contiguous()).clamp(max=path.shape[1] - 1)
    before = ego_d < dist_along[:, :1]
    at = torch.where(before.unsqueeze(-1), ego_xy.unsqueeze(1), torch.gather(path, 1, k.unsqueeze(-1).expand(-1, -1, 2)))
    yaw = torch.where(before, ego_yaw.unsqueeze(1), torch.gather(path_yaw, 1, k))
    return at, yaw, ego_d > dist_along[:, -1:]


def _headings(path: Tensor) -> Tensor:
    """Heading [B,K] of a path [B,K,2] at each point (of the segment it starts; the last keeps the one before)."""
    step = path[:, 1:] - path[:, :-1]
    yaw = torch.atan2(step[..., 1], step[..., 0])
    return torch.cat((yaw, yaw[:, -1:]), 1)
