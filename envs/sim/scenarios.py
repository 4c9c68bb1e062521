"""The route scenarios part: activates each route's scenarios as the Leaderboard does and plays them, batched.

A scenario activates once, when the ego's route index enters its trigger's 2 m circle (``ScenarioTriggerer``);
any number may be live at once. Its actors follow scripted paths at constant speed (pedestrian, cyclist, emergency
vehicle, the junction flows) and are written into the last actor slots of the state (``Setup.scenario_slots``), so
that every observation, infraction check and background driver sees them like any other actor. The junction
scenarios override their junction's lights; ControlLoss perturbs the ego's controls at its debris patches. What each
type does is compiled into tables once (:mod:`envs.sim.scenario_world`); the step indexes them, with no loop over
environments, scenarios or actors, and plays only the rows that have scenario activity.
``../shared/docs/scenarios.md`` is the reference; docs/fidelity.md the differences.

One file, on purpose: activation, motion, slots, light overrides, control noise and outcomes are one part's stages
over the same scenario state, slot groups and tables.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from envs.api import SCENARIO_OUTCOMES, SCENARIO_TYPES
from envs.sim.agents import LIGHT_EMERGENCY, corridor_gap, idm_accel, sizes
from envs.sim.geometry import polyline_pose, true_first
from envs.sim.infractions import INFRACTIONS
from envs.sim.parts import RESPAWN_EVERY, Part
from envs.sim.scenario_world import (DOC_BLOCKER_HALF, FLOW_SLOTS, LEFT, LOSS, LOSS_RADIUS, NUM_GROUPS, RIGHT,
                                     VEHICLE_GROUPS)
from envs.sim.state import ScenarioState, SimState, assign_rows

PENDING, LIVE, DONE = 0, 1, 2
LOSS_NOISE = ((0.055, 0.015), (0.03, 0.01))  # (mean, std) of the steer and throttle noise per 20 Hz tick
LB_TICK = 0.05  # s: the Leaderboard's tick, at which ControlLoss draws its noise
COAST = 1.2  # m/s^2: the emergency vehicle coasts after a collision (empty controls)
COLLISIONS = [INFRACTIONS.index(k) for k in ("collision_vehicle", "collision_pedestrian", "collision_static")]


class RouteScenarios(Part):
    """Plays the world's route scenarios (``world.scn``); inert on a world without any."""

    def bind(self, setup) -> None:  # noqa: ANN001 - Setup
        super().bind(setup)
        w = setup.world
        self.on = w.has_scenarios
        self.tab = w.scn
        self.pad = w.scn.type.shape[0] - 1  # the inert row
        v, p, o = setup.scenario_slots
        self.veh0 = setup.background_vehicles
        self.ped0 = setup.num_pedestrians - p
        self.sta0 = setup.num_statics - o
        # the one slot layout: scenario vehicle slot i shows actor slot_actor[i] (flat over [G, F]) of group
        # slot_group[i]; walker groups show their one actor in the last pedestrian and static slots
        flat = torch.arange(NUM_GROUPS * FLOW_SLOTS, device=setup.device).view(1, NUM_GROUPS, FLOW_SLOTS)
        self.slot_actor = self._vehicle_slots(flat)[0]
        self.slot_group = self.slot_actor // FLOW_SLOTS
        self.noise_ticks = max(1, round(setup.cfg.dt / LB_TICK))
        self.steps = 0
        self.settling = torch.zeros(setup.num_envs, dtype=torch.bool, device=setup.device)  # busy at the last step
        self._overrides_from: tuple[tuple[Tensor, int], ...] = ()  # what _overrides was built from
        self._overrides_value: tuple[Tensor, ...] = ()
        self._fresh = self._fresh_routes() if self.on else None

    # ------------------------------------------------------------------ fresh episodes
    def reset(self, s: SimState, rows: Tensor) -> None:
        """A fresh episode's scenario state and what its slots show before any activation (the blockers, the waiting
        cyclist): gathered from every route's, built once (:meth:`_fresh_routes`); the draws (ControlLoss's noise
        signs, the flow cars' sizes) are the episode's own."""
        st, dev = self.setup, self.setup.device
        B, G, F = len(rows), NUM_GROUPS, FLOW_SLOTS
        if not self.on:  # no draws on a world without scenarios: its random stream stays as it was
            s.scn = self._fresh_state(torch.zeros((B, 1), dtype=torch.long, device=dev),
                                      torch.ones(B, 1, 3, 2, device=dev), torch.ones(B, G, F, 2, device=dev))
            return
        fresh, values = self._fresh
        drawn = ("signs", "act_half")
        signs = torch.where(torch.rand((B, fresh.scn.shape[1], 3, 2), generator=st.gen, device=dev) < 0.5, -1.0, 1.0)
        c = ScenarioState(signs=signs, act_half=sizes((B, G, F), st.gen, dev), **{
            f.name: getattr(fresh, f.name)[s.route_id] for f in dataclasses.fields(fresh) if f.name not in drawn})
        s.scn = c
        self._put_slots(s, tuple((kind, name, first, v[s.route_id]) for kind, name, first, v in values))
        s.veh.half[:, self.veh0:self.veh0 + F] = c.act_half[:, 0]  # the flow cars' drawn sizes

    def _fresh_routes(self) -> tuple[ScenarioState, tuple[tuple[str, str, int, Tensor], ...]]:
        """Every route's fresh scenario state and slot values ([NR, ...]; unit noise signs and sizes, which a reset
        draws)."""
        tab, dev = self.tab, self.setup.device
        scn = torch.where(tab.route_scn >= 0, tab.route_scn, torch.full_like(tab.route_scn, self.pad))
        NR, K = scn.shape
        c = self._fresh_state(scn, torch.ones(NR, K, 3, 2, device=dev),
                              torch.ones(NR, NUM_GROUPS, FLOW_SLOTS, 2, device=dev))
        self._assign_groups(c)
        g = self.group_scenario(c)
        self._show_singles(c, g, torch.zeros_like(g, dtype=torch.bool))
        return c, self._slot_values(c, g)

    @staticmethod
    def _fresh_state(scn: Tensor, signs: Tensor, half: Tensor) -> ScenarioState:
        """Scenarios ``scn`` [B, K] all pending, no actor shown (``signs`` [B, K, 3, 2], ``half`` [B, G, F, 2])."""
        (B, K), G, F, dev = scn.shape, NUM_GROUPS, FLOW_SLOTS, scn.device
        zk, zb = torch.zeros(B, K, device=dev), torch.zeros(B, K, dtype=torch.bool, device=dev)
        return ScenarioState(
            scn=scn, status=torch.zeros(B, K, dtype=torch.long, device=dev), t_act=zk.clone(), act_m=zk.clone(),
            fin_m=zk + math.inf, moving=zb.clone(), collided=zb.clone(), hit=zb.clone(), timed_out=zb.clone(),
            preempted=zb.clone(), patch=torch.zeros(B, K, dtype=torch.long, device=dev), near=zb.clone(), signs=signs,
            owner=torch.full((B, G), K, dtype=torch.long, device=dev), act_s=torch.zeros(B, G, F, device=dev),
            act_v=torch.zeros(B, G, F, device=dev), act_alive=torch.zeros(B, G, F, dtype=torch.bool, device=dev),
            act_half=half, next_gap=torch.zeros(B, G, device=dev),
            prev_collisions=torch.zeros(B, dtype=torch.long, device=dev),
            timeouts=torch.zeros(B, dtype=torch.long, device=dev))

    # ------------------------------------------------------------------ the step
    def control(self, s: SimState, action: Tensor) -> Tensor:
        """ControlLoss (``AddNoiseToRouteEgo``): while the ego is within 2 m of a live scenario's next debris patch,
        its steer and throttle get noise N(±mean, std) (one sign per patch; ``noise_ticks`` 20 Hz draws averaged
        per step). Throttle noise while braking eases the brake by the same acceleration."""
        if not self.on:
            return action
        c, tab, st = s.scn, self.tab, self.setup
        draws = torch.randn(c.status.shape + (2,), generator=st.gen, device=st.device)  # every row's, as in step()
        noise = torch.zeros_like(action)
        live = (c.status == LIVE) & (tab.type[c.scn] == LOSS)
        rows = torch.nonzero((live | c.near).any(1)).flatten()  # the others have no noise to add
        if len(rows):
            scn, was_near = c.scn[rows], c.near[rows]
            live = live[rows] & (c.patch[rows] < 3)
            at = lambda x, patch: x.gather(  # noqa: E731 - x [R,K,3,2] at each scenario's patch
                2, patch.clamp(max=2)[..., None, None].expand(-1, -1, 1, 2)).squeeze(2)
            gap = (at(tab.patch_xy[scn], c.patch[rows]) - s.ego_xy[rows].unsqueeze(1)).norm(dim=-1)
            near = live & (gap < LOSS_RADIUS)
            patch = c.patch[rows] + (was_near & ~near).long()  # the ego has left the patch: the next one
            c.patch, c.near = c.patch.index_put((rows,), patch), c.near.index_put((rows,), near)
            mean = torch.tensor([m for m, _ in LOSS_NOISE], device=st.device)
            std = torch.tensor([d for _, d in LOSS_NOISE], device=st.device) / math.sqrt(self.noise_ticks)
            draw = at(c.signs[rows], patch) * mean + std * draws[rows]  # [R,K,2]
            noise = noise.index_put((rows,), torch.where(near.unsqueeze(-1), draw, torch.zeros_like(draw)).sum(1))
        steer = (action[:, 0] + noise[:, 0]).clamp(-1.0, 1.0)
        lon = action[:, 1]
        lon = torch.where(lon >= 0, (lon + noise[:, 1]).clamp(0.0, 1.0),
                          (lon + noise[:, 1] * st.cfg.max_accel / st.cfg.max_brake).clamp(max=0.0))
        return torch.stack((steer, lon), -1)

    # whether the scenario slots keep between steps what this part wrote, so that idle rows can be skipped: the
    # simulator's traffic never shows or moves a shown scenario actor (its pedestrian step repositions the hidden ones,
    # which every reader masks); a part whose actor source rewrites every slot from outside (a CARLA server's reading)
    # plays every row
    keeps_slots = True

    def step(self, s: SimState) -> None:
        """Activate, move, end; then write the actors into their slots (after the other actors moved).

        Only busy rows are played: a scenario fires or is live, an actor is shown, or the row was busy at the last
        step (it settles: the slot groups move on to their next scenario). An idle row is at a fixed point of the
        step (nothing fires, moves or ends; its slots hold what they held), and at batch 1024 most rows are idle, so
        the step gathers the busy rows, plays them and writes them back."""
        if not self.on:
            return
        c, tab, st = s.scn, self.tab, self.setup
        ri = s.route_idx.unsqueeze(1)
        fire = (c.status == PENDING) & (ri >= tab.act_first[c.scn]) & (ri <= tab.act_last[c.scn])
        # the flows' gap draws, for every row: the random stream does not depend on which rows are busy
        draws = torch.rand(c.act_s.shape, generator=st.gen, device=st.device)
        busy = fire.any(1) | (c.status == LIVE).any(1) | c.act_alive.flatten(1).any(1)
        if self.keeps_slots:
            rows = torch.nonzero(busy | self.settling).flatten()  # one host sync
            self.settling = busy
        else:
            rows = torch.arange(len(busy), device=busy.device)
        if len(rows) == 0:
            return
        r = BusyRows.gather(s, rows, st.world.route_cum, st.ego_half)
        self._play(r, fire[rows], draws[rows])
        r.scatter(s, rows)
        self._put_slots(s, self._slot_values(r.scn, self.group_scenario(r.scn)), rows)

    def _play(self, r: BusyRows, fire: Tensor, draws: Tensor) -> None:
        """The step on rows ``r``: activate the scenarios that ``fire``, assign the slot groups, start, move, show and
        end the actors (``draws``: U(0, 1) [R, G, F] for the flows' gaps)."""
        c, tab, dt = r.scn, self.tab, self.setup.cfg.dt
        c.status = torch.where(fire, LIVE, c.status)
        c.t_act = torch.where(fire, r.t.unsqueeze(1), c.t_act)
        c.act_m = torch.where(fire, r.route_m.unsqueeze(1), c.act_m)
        self._assign_groups(c)
        g = self.group_scenario(c)  # [R,G] table row each group shows
        live_g = self._group_status(c) == LIVE
        # single actors start by the ego's time to arrival at the conflict point (or its distance)
        d = (tab.c_xy[c.scn] - r.ego_xy.unsqueeze(1)).norm(dim=-1)
        tta = d / r.ego_speed.clamp(min=1e-3).unsqueeze(1)
        start = (c.status == LIVE) & ~c.moving & ((tta < tab.react[c.scn]) | (d < tab.min_dist[c.scn]))
        c.moving |= start & (tab.react[c.scn] > 0)
        self._move(r, g, live_g, dt, draws)
        self._show_singles(c, g, live_g)
        self._end(r)

    def _assign_groups(self, c: ScenarioState) -> None:
        """Each slot group shows its latest live scenario, else its next pending one; an older live one in the same
        group ends (preempted). A group that changes scenario starts its actors afresh."""
        tab = self.tab
        B, K = c.status.shape
        member = tab.group[c.scn].unsqueeze(-1) == torch.arange(NUM_GROUPS, device=c.status.device)  # [B,K,G]
        k = torch.arange(K, device=c.status.device).view(1, K, 1)
        live_k = torch.where(member & (c.status == LIVE).unsqueeze(-1), k, -1).amax(1)  # [B,G]
        # the first pending one as K - max(K - k): int64 amin is ~15x slower than amax on CPU (measured on an AVX2
        # Zen 3; docs/simulator.md, "Broadcasts and reductions")
        pend_k = K - torch.where(member & (c.status == PENDING).unsqueeze(-1), K - k, 0).amax(1)
        owner = torch.where(live_k >= 0, live_k, pend_k)
        older = (c.status == LIVE) & member.any(-1) & (
            torch.gather(live_k, 1, tab.group[c.scn].clamp(min=0)) != k.squeeze(-1))
        c.preempted |= older
        c.status = torch.where(older, DONE, c.status)
        changed = owner != c.owner
        c.owner = owner
        row = self.group_scenario(c)
        fresh = changed.unsqueeze(-1)
        c.act_alive = torch.where(fresh, False, c.act_alive)
        c.act_s = torch.where(fresh, 0.0, c.act_s)
        c.act_v = torch.where(fresh, tab.speed[row].unsqueeze(-1), c.act_v)
        c.next_gap = torch.where(changed, 0.0, c.next_gap)

    def _is_flow(self, g: Tensor) -> Tensor:
        """Whether table rows ``g`` are junction flows (the left and right turns' streams of cars)."""
        return (self.tab.type[g] == LEFT) | (self.tab.type[g] == RIGHT)

    def group_scenario(self, c: ScenarioState) -> Tensor:
        """[B,G] the table row each slot group shows (the inert row for none)."""
        K = c.status.shape[1]
        row = torch.gather(c.scn, 1, c.owner.clamp(max=K - 1))
        return torch.where(c.owner < K, row, torch.full_like(row, self.pad))

    def _group_status(self, c: ScenarioState) -> Tensor:
        K = c.status.shape[1]
        st = torch.gather(c.status, 1, c.owner.clamp(max=K - 1))
        return torch.where(c.owner < K, st, torch.full_like(st, DONE))

    def _group_flag(self, c: ScenarioState, flag: Tensor) -> Tensor:
        K = c.status.shape[1]
        return torch.gather(flag, 1, c.owner.clamp(max=K - 1)) & (c.owner < K)

    def _move(self, r: BusyRows, g: Tensor, live_g: Tensor, dt: float, draws: Tensor) -> None:
        """Flows: cars advance at the flow's speed (minding the ego and each other, with IDM, once one of them hit
        it), leave at the sink, and a new car enters whenever the last one is U(lo, hi) m from the source (pre-filled
        flows start full except inside the junction), also after a collision, as ``ActorFlow`` goes on spawning.
        Single actors walk or drive their path once started, then leave."""
        c, tab = r.scn, self.tab
        is_flow = self._is_flow(g)
        flow = live_g & is_flow  # [B,G]
        collided = self._group_flag(c, c.hit)  # its own actor hit: a single coasts, a flow minds vehicles
        moving = self._group_flag(c, c.moving)
        c.act_v = torch.where((collided & ~is_flow).unsqueeze(-1), (c.act_v - COAST * dt).clamp(min=0.0), c.act_v)
        careful = (collided & is_flow).unsqueeze(-1)
        if bool(careful.any()):  # one host sync; skips the flows' IDM on most steps
            c.act_v = torch.where(careful, self._careful_speed(r, g, dt), c.act_v)
        go = c.act_alive & (flow | moving).unsqueeze(-1)
        c.act_s = torch.where(go, c.act_s + c.act_v * dt, c.act_s)
        # single actors (slot 0): shown from activation (or from the start: the cyclist) until they have moved
        # move_dist, or until the ego hit them (the rules removed them: their crossing ends there, and with it the
        # blocker); flows: until the sink
        end = torch.where(flow, tab.path_len[g], tab.move_dist[g]).unsqueeze(-1)
        finished = c.act_alive & (c.act_s >= end)
        unfinished = ~self._group_flag(c, torch.isfinite(c.fin_m))
        single_done = ~is_flow & ((finished[..., 0] & moving) | (collided & unfinished & live_g))
        c.fin_m = torch.where(self._scatter_k(c, single_done), r.route_m.unsqueeze(1), c.fin_m)
        c.act_alive &= ~finished
        # fresh flows: pre-fill along the path (outside the junction), then the spawn rule
        first = flow & (c.next_gap == 0)
        gaps = tab.gap_lo[g].unsqueeze(-1) + draws * (tab.gap_hi[g] - tab.gap_lo[g]).unsqueeze(-1)
        pos = gaps.cumsum(-1) - gaps[..., :1]  # 0, g1, g1 + g2, ...
        idx = pos.long().clamp(max=tab.path.shape[1] - 1)
        inside = tab.path_junction[g.unsqueeze(-1), idx]
        prefill = first & tab.prefill[g]
        fill = prefill.unsqueeze(-1) & (pos < tab.path_len[g].unsqueeze(-1)) & ~inside
        fill[..., 0] |= first & ~tab.prefill[g]
        c.act_alive |= fill
        c.act_s = torch.where(fill, torch.where(prefill.unsqueeze(-1), pos, 0.0), c.act_s)
        c.act_v = torch.where(fill, tab.speed[g].unsqueeze(-1), c.act_v)
        nearest = torch.where(c.act_alive, c.act_s, torch.full_like(c.act_s, math.inf)).amin(-1)
        spawn = flow & ~first & (nearest > c.next_gap) & ~c.act_alive.all(-1)  # after a collision too (ActorFlow)
        slot = (~c.act_alive).float().argmax(-1, keepdim=True)
        new = torch.zeros_like(c.act_alive).scatter(2, slot, spawn.unsqueeze(-1))
        c.act_alive |= new
        c.act_s = torch.where(new, 0.0, c.act_s)
        c.act_v = torch.where(new, tab.speed[g].unsqueeze(-1), c.act_v)
        redraw = first | spawn
        c.next_gap = torch.where(redraw, gaps[..., 0], c.next_gap)

    def next_flow_cars(self, s: SimState) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The flows' next two cars, not yet spawned, as cars on the source's heading still behind it: the next one
        where it spawns by the flow's drawn gap (it appears once the last car is ``next_gap`` m from the source), the
        one after at the earliest its rule allows (``gap_lo`` further back): (xy [B,G,2,2], yaw [B,G,2], speed
        [B,G,2], valid [B,G,2]). What a driver who knows the flow's rule and draws must expect from the unseen part of
        the stream (privileged, as the scripted paths: the expert yields to it)."""
        c, tab = s.scn, self.tab
        g = self.group_scenario(c)
        is_flow = self._is_flow(g)
        valid = is_flow & (self._group_status(c) == LIVE) & ~c.act_alive.all(-1)
        nearest = torch.where(c.act_alive, c.act_s, torch.full_like(c.act_s, math.inf)).amin(-1)
        first = (nearest - c.next_gap).clamp(max=0.0)  # m along the path (<= 0; no car yet: inf -> 0)
        back = torch.stack((first, first - tab.gap_lo[g]), -1)  # [B,G,2]
        src, nxt = tab.path[g, 0], tab.path[g, 1]
        heading = nxt - src
        yaw = torch.atan2(heading[..., 1], heading[..., 0])
        unit = heading / heading.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        xy = src.unsqueeze(2) + unit.unsqueeze(2) * back.unsqueeze(-1)
        two = (-1, -1, 2)
        return (xy, yaw.unsqueeze(-1).expand(two), tab.speed[g].unsqueeze(-1).expand(two),
                valid.unsqueeze(-1).expand(two))

    def _show_singles(self, c: ScenarioState, g: Tensor, live_g: Tensor) -> None:
        """Single actors appear at activation (the cyclist before it, standing) until they finish or are hit."""
        tab = self.tab
        is_flow = self._is_flow(g)
        single = ~is_flow & (tab.group[g] >= 0) & ~self._group_flag(c, (c.fin_m < math.inf) | c.hit)
        show = single & (live_g | (tab.show_early[g] & (self._group_status(c) == PENDING)))
        c.act_alive[..., 0] = torch.where(single & ~c.act_alive[..., 0] & (c.act_s[..., 0] == 0), show,
                                          c.act_alive[..., 0])

    def _careful_speed(self, r: BusyRows, g: Tensor, dt: float) -> Tensor:
        """A flow after a collision (``ActorFlow``: its cars stop ignoring vehicles): IDM towards the flow's speed,
        behind the ego or the car ahead of them (they queue), whichever is nearer in their way."""
        c = r.scn
        B, G, F = c.act_s.shape
        xy, yaw = self._pose(g.unsqueeze(-1).expand_as(c.act_s), c.act_s)
        xy, yaw, half = xy.view(B, G * F, 2), yaw.view(B, G * F), c.act_half.view(B, G * F, 2)
        obstacles = (torch.cat((r.ego_xy.unsqueeze(1), xy), 1), torch.cat((r.ego_yaw.unsqueeze(1), yaw), 1),
                     torch.cat((r.ego_speed.unsqueeze(1), c.act_v.view(B, G * F)), 1),
                     torch.cat((r.ego_half.unsqueeze(1), half), 1),
                     torch.cat((torch.ones(B, 1, dtype=torch.bool, device=xy.device),
                                (c.act_alive & self._is_flow(g).unsqueeze(-1)).view(B, G * F)), 1))  # flow cars
        gap, lead_v = corridor_gap(xy, yaw, half, *obstacles)  # a car is not ahead of itself (ahead > 0)
        v = c.act_v.view(B, G * F)
        acc = idm_accel(v, self.tab.speed[g].unsqueeze(-1).expand_as(c.act_v).reshape(B, G * F), gap, v - lead_v)
        return (v + acc * dt).clamp(min=0.0).view(B, G, F)

    def _scatter_k(self, c: ScenarioState, per_group: Tensor) -> Tensor:
        """A [B,G] flag of the groups' scenarios as a [B,K] flag (a group without a scenario, owner K, flags none: a
        scatter to its clamped index could overwrite the flag of scenario K - 1)."""
        K = c.status.shape[1]
        return ((c.owner.unsqueeze(-1) == torch.arange(K, device=c.owner.device)) & per_group.unsqueeze(-1)).any(1)

    def _end(self, r: BusyRows) -> None:
        """End rules: a route point reached (junction types), metres after the actors finished or after activation,
        or the scenario timeout (x0.7; the blocked timer is off while a timeout runs)."""
        c, tab = r.scn, self.tab
        live = c.status == LIVE
        m = r.route_m.unsqueeze(1)
        end_idx = tab.end_idx[c.scn]
        by_point = (end_idx >= 0) & (r.route_idx.unsqueeze(1) >= end_idx)
        by_metres = (end_idx < 0) & torch.where(tab.end_from_act[c.scn], m >= c.act_m + tab.end_after_m[c.scn],
                                                m >= c.fin_m + tab.end_after_m[c.scn])
        timed_out = live & (r.t.unsqueeze(1) - c.t_act >= tab.timeout_s[c.scn])
        ended = live & (by_point | by_metres | timed_out)
        c.timed_out |= timed_out
        c.timeouts = c.timeouts + timed_out.sum(1)
        c.status = torch.where(ended, DONE, c.status)
        waiting = ((c.status == LIVE) & torch.isfinite(tab.timeout_s[c.scn])).any(1)
        r.still_time = torch.where(waiting, torch.zeros_like(r.still_time), r.still_time)
        gone = self._group_status(c) == DONE
        c.act_alive &= ~gone.unsqueeze(-1)

    def _write(self, s: SimState, g: Tensor) -> None:
        """The groups' actors (table rows ``g`` [B, G]) into their slots on every row of ``s``."""
        self._put_slots(s, self._slot_values(s.scn, g))

    def _slot_values(self, c: ScenarioState, g: Tensor) -> tuple[tuple[str, str, int, Tensor], ...]:
        """What the scenario slots show, as (actor kind, field, first slot, value) for :meth:`_put_slots`: the flow
        group's cars and the single vehicles in the last vehicle slots, pedestrians and their blockers in the last
        pedestrian and static slots. Only the actors that exist are posed: group 0's cars (it carries the flows) and
        the other groups' one actor each."""
        tab = self.tab
        V, F = len(VEHICLE_GROUPS), c.act_s.shape[2]
        cars_xy, cars_yaw = self._pose(g[:, :1].expand_as(c.act_s[:, 0]), c.act_s[:, 0])  # [B,F]
        one_xy, one_yaw = self._pose(g[:, 1:], c.act_s[:, 1:, 0])  # [B,G-1]: groups 1..
        moving = self._group_flag(c, c.moving)
        gv, gw, a, p, o = g[:, 1:V], g[:, V:], self.veh0, self.ped0, self.sta0
        lights = torch.where(tab.emergency[gv], LIGHT_EMERGENCY, 0)
        blocked = tab.blocker_on[gw] & (self._group_status(c)[:, V:] != DONE) & ~self._group_flag(
            c, c.fin_m < math.inf)[:, V:]
        return (
            ("veh", "xy", a, torch.cat((cars_xy, one_xy[:, :V - 1]), 1)),
            ("veh", "yaw", a, torch.cat((cars_yaw, one_yaw[:, :V - 1]), 1)),
            ("veh", "speed", a, torch.cat((c.act_v[:, 0], torch.where(moving[:, 1:V], c.act_v[:, 1:V, 0], 0.0)), 1)),
            ("veh", "half", a, torch.cat((c.act_half[:, 0], tab.actor_half[gv]), 1)),
            ("veh", "valid", a, self._vehicle_slots(c.act_alive)),
            ("veh", "lights", a, torch.cat((torch.zeros_like(lights[:, :1]).expand(-1, F), lights), 1)),
            ("ped", "xy", p, one_xy[:, V - 1:]),
            ("ped", "yaw", p, one_yaw[:, V - 1:]),
            ("ped", "speed", p, c.act_v[:, V:, 0]),
            ("ped", "moving", p, moving[:, V:]),
            ("ped", "valid", p, c.act_alive[:, V:, 0]),
            ("statics", "xy", o, tab.blocker_xy[gw]),
            ("statics", "yaw", o, tab.blocker_yaw[gw]),
            ("statics", "half", o, c.act_half.new_tensor(DOC_BLOCKER_HALF).expand(*gw.shape, 2)),
            ("statics", "valid", o, blocked))

    @staticmethod
    def _put_slots(s: SimState, values: tuple[tuple[str, str, int, Tensor], ...], rows: Tensor | None = None) -> None:
        """Write :meth:`_slot_values` into the state's actor tensors, on every row or on ``rows``."""
        for kind, name, first, value in values:
            target = getattr(getattr(s, kind), name)
            if rows is None:
                target[:, first:] = value
            else:
                target[rows, first:] = value.to(target.dtype)

    @staticmethod
    def _vehicle_slots(x: Tensor) -> Tensor:
        """[B, G, F, ...] per group and actor -> [B, FLOW_SLOTS + singles, ...] in the order of the scenario vehicle
        slots: the flow group's cars, then each single-vehicle group's one actor."""
        return torch.cat((x[:, 0], x[:, list(VEHICLE_GROUPS[1:]), 0]), 1)

    def vehicle_forecast(self, s: SimState, taus: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Where the scenario vehicles will be at times ``taus`` [T] on their scripted paths at their present speed
        (privileged: the expert's forecast of actors that ignore the ego): (xy [B,V,T,2], yaw [B,V,T], gone [B,V,T]:
        past the path's end, or not shown), V the scenario vehicle slots in slot order."""
        c, tab = s.scn, self.tab
        g = self.group_scenario(c)
        is_flow = self._is_flow(g)
        speed = torch.where((self._group_flag(c, c.moving) | is_flow).unsqueeze(-1), c.act_v, torch.zeros_like(c.act_v))
        end = torch.where(is_flow, tab.path_len[g], tab.move_dist[g])  # as _move removes them
        # only the actors with a vehicle slot (a quarter of [G, F]) are posed
        slot = lambda x: self._vehicle_slots(x.unsqueeze(-1).expand_as(c.act_s))  # noqa: E731 - [B,G] -> [B,V]
        along = self._vehicle_slots(c.act_s).unsqueeze(-1) + self._vehicle_slots(speed).unsqueeze(-1) * taus  # [B,V,T]
        xy, yaw = self._pose(slot(g).unsqueeze(-1).expand_as(along), along)
        gone = ~self._vehicle_slots(c.act_alive).unsqueeze(-1) | (along >= slot(end).unsqueeze(-1))
        return xy, yaw, gone

    def _pose(self, g: Tensor, s_along: Tensor) -> tuple[Tensor, Tensor]:
        """Position and heading at arc length ``s_along`` on the paths of table rows ``g`` (1 m points)."""
        return polyline_pose(self.tab.path, g, s_along, self.tab.path_last[g])

    def close(self) -> None:
        """Release what the scenarios hold outside this process (a server's actors); nothing here."""

    def refresh(self, s: SimState) -> None:
        """After the actor source's refresh (the simulator's traffic leaves the scenario slots alone; a backend
        whose source rewrites every slot writes the actors again): the live scenarios' background hooks, at the
        traffic's respawn rate."""
        self.steps += 1
        if self.on and self.steps % RESPAWN_EVERY == 0:
            self.clear_background(s)

    def clear_background(self, s: SimState) -> None:
        """``HandleJunctionScenario``: the background vehicles in a live scenario's junction and on its lane
        segments (``ScenarioTables.clear_*``) leave the state; the traffic respawns them elsewhere (never there: this
        runs after each respawn)."""
        c, tab, bg = s.scn, self.tab, self.veh0
        g = self.group_scenario(c)
        live = (self._group_status(c) == LIVE).unsqueeze(1)  # [B,1,G]
        lane, along = s.veh.lane[:, :bg], s.veh.s[:, :bg]
        jid = self.setup.world.lane_junction_id[lane].unsqueeze(-1)  # [B,A,1]
        in_junction = ((jid >= 0) & (jid == tab.clear_junction[g].unsqueeze(1)) & live).any(-1)  # [B,A]
        a = along[..., None, None]  # [B,A,1,1] against the segments [B,1,G,C]
        on = (lane[..., None, None] == tab.clear_lane[g].unsqueeze(1)) & (a >= tab.clear_lo[g].unsqueeze(1)) & (
            a <= tab.clear_hi[g].unsqueeze(1)) & live.unsqueeze(-1)
        s.veh.valid[:, :bg] &= ~(in_junction | on.flatten(2).any(-1))

    # ------------------------------------------------------------------ lights
    def lights(self, s: SimState, group: Tensor, state: Tensor, yellow_left: Tensor) -> tuple[Tensor, Tensor]:
        """The light overrides of live junction scenarios (``TrafficLightFreezer``): in their junction the ego's light
        is red for ``ego_red_s`` then green, the flow's green, all others red."""
        if not self.on:
            return state, yellow_left
        rows, jn, ego, src, t_act, red_s = self._overrides(s.scn)
        if len(rows) == 0:
            return state, yellow_left
        group = group[rows]  # [R,N]: only the rows with a live override
        in_j = (self.setup.world.group_junction[group.clamp(min=0)].unsqueeze(-1) == jn.unsqueeze(1)) & (
            group >= 0).unsqueeze(-1) & (jn >= 0).unsqueeze(1)  # [R,N,J]
        red_phase = (s.t[rows].unsqueeze(1) - t_act) < red_s
        is_ego = group.unsqueeze(-1) == ego.unsqueeze(1)
        is_src = group.unsqueeze(-1) == src.unsqueeze(1)
        forced = torch.where(is_ego, torch.where(red_phase.unsqueeze(1), 2, 0), torch.where(is_src, 0, 2))
        any_j = in_j.any(-1)
        pick = in_j.byte().argmax(-1, keepdim=True)
        new = torch.gather(forced, 2, pick).squeeze(-1)
        state_r, yellow_r = state[rows], yellow_left[rows]
        return (state.index_put((rows,), torch.where(any_j, new, state_r).to(state.dtype)),
                yellow_left.index_put((rows,), torch.where(any_j, torch.zeros_like(yellow_r), yellow_r)))

    def _overrides(self, c: ScenarioState) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The rows with a live override (``rows`` [R]) and their overrides, first in scenario order ([R, J], not
        [B, K]): junction, the ego's and the flow's light groups, activation time, how long the ego's light stays red
        after it. Every light lookup of a step (traffic, rules, observer) shares them: rebuilt only when the
        scenarios, their status or activation times are other tensors or were written since (the tensors are held,
        so a new one cannot take an old one's identity)."""
        sources = (c.scn, c.status, c.t_act)
        if not self._overrides_from or any(
                t is not held or t._version != version for t, (held, version) in zip(sources, self._overrides_from)):
            tab = self.tab
            live = c.status == LIVE
            cand = torch.nonzero(live.any(1)).flatten()  # host syncs and a sort: once per step, not once per lookup
            jn = torch.where(live[cand], tab.light_junction[c.scn[cand]], -1)  # [C,K]
            has = (jn >= 0).any(1)
            rows, jn = cand[has], jn[has]
            k = true_first(jn >= 0)
            scn = c.scn[rows].gather(1, k)
            self._overrides_value = (rows, jn.gather(1, k), tab.light_ego[scn], tab.light_src[scn],
                                     c.t_act[rows].gather(1, k), tab.ego_red_s[scn])
            self._overrides_from = tuple((t, t._version) for t in sources)
        return self._overrides_value

    # ------------------------------------------------------------------ outcomes
    def record(self, s: SimState) -> None:
        """After the rules judged the step: an ego collision while a scenario is live counts against it."""
        if not self.on:
            return
        c = s.scn
        n = s.counts[:, COLLISIONS].sum(1)
        hit = n > c.prev_collisions
        c.prev_collisions = n
        c.collided |= hit.unsqueeze(1) & (c.status == LIVE)
        # actors the rules removed from the world (a collision under Leaderboard rules) stay gone
        B, G, F = c.act_alive.shape
        shown = c.act_alive.clone()
        shown.view(B, G * F)[:, self.slot_actor] = s.veh.valid[:, self.veh0:]
        shown[:, len(VEHICLE_GROUPS):, 0] = s.ped.valid[:, self.ped0:]
        gone = (c.act_alive & ~shown).any(-1)  # [B,G]
        c.act_alive &= shown
        c.hit |= self._scatter_k(c, gone)
        c.collided |= c.hit

    def episode_info(self, s: SimState) -> dict[str, Tensor]:
        """``episode/scenarios/<type>/<outcome>``: per type, scenarios triggered, passed (ended without a collision
        or timeout), collided, timed out, preempted, and not reached by the episode's end; and the timeouts."""
        if not self.on:
            return {}
        c, tab = s.scn, self.tab
        real = c.scn != self.pad
        done_ok = (c.status == DONE) & ~c.collided & ~c.timed_out & ~c.preempted
        flags = torch.stack((c.status > PENDING, done_ok, c.collided, c.timed_out, c.preempted, c.status == PENDING),
                            -1) & real.unsqueeze(-1)  # [B,K,O]
        # per type: a scatter-add over the scenarios (a one-hot einsum ran as 1,024 tiny matmuls, 3x slower on CPU)
        (B, K, O), T = flags.shape, len(SCENARIO_TYPES)
        per_type = flags.new_zeros((B, T, O), dtype=torch.float32).scatter_add_(
            1, tab.type[c.scn].unsqueeze(-1).expand(B, K, O), flags.float())  # [B,T,O]
        table = per_type.permute(1, 2, 0).reshape(T * O, B).unbind(0)
        keys = (f"episode/scenarios/{name}/{o}" for name in SCENARIO_TYPES for o in SCENARIO_OUTCOMES)
        info = dict(zip(keys, table))
        info["episode/infractions/scenario_timeout"] = c.timeouts.float()
        return info


@dataclass
class BusyRows:
    """The rows of the state the scenario step plays (``rows`` of the batch): their scenario state and what the step
    reads and writes of the rest; :meth:`scatter` writes them back."""

    scn: ScenarioState
    route_idx: Tensor
    route_m: Tensor  # route metres at the ego's route point
    t: Tensor
    ego_xy: Tensor
    ego_yaw: Tensor
    ego_speed: Tensor
    ego_half: Tensor
    still_time: Tensor

    @classmethod
    def gather(cls, s: SimState, rows: Tensor, route_cum: Tensor, ego_half: Tensor) -> BusyRows:
        route_id, route_idx = s.route_id[rows], s.route_idx[rows]
        scn = ScenarioState(**{f.name: getattr(s.scn, f.name)[rows] for f in dataclasses.fields(s.scn)})
        return cls(scn, route_idx, route_cum[route_id, route_idx], s.t[rows], s.ego_xy[rows], s.ego_yaw[rows],
                   s.ego_speed[rows], ego_half[rows], s.still_time[rows])

    def scatter(self, s: SimState, rows: Tensor) -> None:
        """Write the rows back into ``s``, in place."""
        assign_rows(s.scn, rows, self.scn)
        s.still_time[rows] = self.still_time
