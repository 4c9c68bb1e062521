"""The parts a simulator core (:class:`envs.sim.env.SimEnv`) is assembled from, and the built-in simulator's own.

A backend is the core plus its parts (composition, as in Waymax), not a subclass. The core owns the state layout,
the clock and the order of the step (``docs/architecture.md``); the parts decide how the world moves (starts, ego,
actors, lights), what the rules are (:mod:`envs.sim.rules`), what the reward is (:mod:`envs.sim.rewards`), what is
observed (:class:`Observer`) and what more is measured (:class:`Metrics`). Each part gets the env's fixed
:class:`~envs.sim.state.Setup` once (:meth:`Part.bind`) and, per call, the state and what else it reads (a light
lookup, the rules' judgement); a backend's own data (nuPlan's logs, CARLA's session) goes to its parts when they are
built. No part reaches another through the core.

* fresh episodes for rows ``rows``: ``starts.pick`` -> ``starts.place`` -> ``ego.reset`` -> ``actors.reset`` ->
  ``scenarios.reset`` -> ``lights.reset`` -> ``reward.reset`` -> ``metrics.reset`` (the random draws of the built-in
  simulator follow this order);
* a step: ``scenarios.control`` -> ``ego.step`` -> ``actors.step`` -> the clock advances -> ``lights.step`` ->
  ``rules.track`` -> ``scenarios.step`` -> ``rules.judge`` -> ``reward.reward`` -> the counts ->
  ``scenarios.record`` -> ``metrics.record`` -> episode statistics -> auto-reset of finished rows ->
  ``actors.refresh`` -> ``scenarios.refresh`` -> ``observer.observe`` (``reset`` ends with it too). The route scenarios
  (:mod:`envs.sim.scenarios`) also answer every light lookup with their overrides.

Every call is batched over the rows of the state it gets. Parts may keep their own per-row state in an extension of
the state dataclass (``SimEnv(state_type=...)``, e.g. :class:`envs.nuplan.logs.NuplanState`), filled in ``reset``.
"""
from __future__ import annotations

import abc
import dataclasses

import torch
from torch import Tensor

from envs.api import ACTIONS, OBS_BEV, TensorSpec
from envs.sim import agents
from envs.sim.dynamics import GEAR_UP_SPEEDS, bicycle_step
from envs.sim.geometry import wrap_angle
from envs.sim.infractions import HISTORY
from envs.sim.state import Setup, SimState, obstacles
from envs.sim.world import ForecastFn, LightFn, light_state

RESPAWN_EVERY = 10  # steps between moves of far-away vehicles back near the ego


class Part:
    """Something the core calls at fixed points of its step; ``setup`` is set by :meth:`bind`."""

    setup: Setup

    def bind(self, setup: Setup) -> None:
        """Attach the part to the env it serves (once, when the env is built)."""
        self.setup = setup


class StartSource(Part, abc.ABC):
    """Where episodes start: the route (scenario) a fresh episode drives, and the ego's place on it. Keeps the fixed
    assignment of evaluation (row ``i`` drives route ``first_route + i``, then ``+ route_stride`` per episode)."""

    def bind(self, setup: Setup) -> None:
        super().bind(setup)
        self.stride = setup.cfg.route_stride or setup.num_envs  # rows advance by this many routes
        self.restart()

    def restart(self) -> None:
        """Back to the first routes of the fixed assignment."""
        st = self.setup
        self.next_route = (st.cfg.first_route + torch.arange(st.num_envs, device=st.device)) % st.world.num_routes

    def advance(self, done: Tensor) -> None:
        """Rows ``done`` [B] move on to their next route of the fixed assignment."""
        self.next_route = torch.where(done, (self.next_route + self.stride) % self.setup.world.num_routes,
                                      self.next_route)

    @abc.abstractmethod
    def pick(self, rows: Tensor) -> Tensor:
        """Route ids [len(rows)] for fresh episodes in the environments ``rows``."""

    @abc.abstractmethod
    def place(self, s: SimState, rows: Tensor) -> None:
        """Place the ego of fresh episodes ``s`` (``route_id`` set): ``ego_xy``, ``ego_yaw``, ``ego_speed``,
        ``ego_vel_local``, and the comfort history ``hist_speed``, ``hist_yaw`` it starts with."""


class EgoDynamics(Part, abc.ABC):
    """How an action moves the ego; ``action_names`` names the action's components (the env's ``action_spec``)."""

    action_names: tuple[str, ...] = ACTIONS

    def reset(self, s: SimState, rows: Tensor) -> None:
        """Initialise the model's own state of fresh episodes ``s`` (after the ego was placed); none by default."""

    @abc.abstractmethod
    def step(self, s: SimState, action: Tensor) -> None:
        """Advance the ego by ``cfg.dt`` under ``action`` [B, 2] (steer, longitudinal; clipped to [-1, 1]): set
        ``ego_xy``, ``ego_yaw``, ``ego_speed``, ``ego_vel_local``, ``last_action`` and, where the model has a
        gearbox, ``gear`` (1 otherwise)."""


class ActorSource(Part, abc.ABC):
    """The other road users: ``s.veh``, ``s.ped`` and ``s.statics`` (padded to the setup's slot counts)."""

    @abc.abstractmethod
    def reset(self, s: SimState, rows: Tensor) -> None:
        """The actors of fresh episodes ``s`` (ego placed, light offsets not yet drawn)."""

    @abc.abstractmethod
    def step(self, s: SimState, lights: LightFn) -> None:
        """Advance the actors by ``cfg.dt`` (after the ego moved, before the clock advances); ``lights`` tells the
        colour of the light groups now."""

    def refresh(self, s: SimState) -> None:
        """Last change before the observation is drawn, after finished rows restarted; nothing by default."""

    def close(self) -> None:
        """Release what the actors hold outside this process (a server's actors); nothing by default."""


class LightSource(Part, abc.ABC):
    """The colours of the map's light groups."""

    @abc.abstractmethod
    def reset(self, s: SimState, rows: Tensor) -> None:
        """Set ``s.light_offset`` [B, J] (per-junction cycle offsets) of fresh episodes ``s``."""

    def step(self, s: SimState) -> None:
        """Follow the clock, which has just advanced to ``s.t``; nothing by default."""

    @abc.abstractmethod
    def state(self, s: SimState, group: Tensor) -> tuple[Tensor, Tensor]:
        """Light groups [B, N] (-1 = none) -> (state 0 green / 1 yellow / 2 red, seconds of yellow left)."""


class Metrics(Part):
    """More measurements of a backend's episodes (e.g. nuPlan's closed-loop score): they watch the step and never
    change its outcome. Every method does nothing by default."""

    def reset(self, s: SimState, rows: Tensor) -> None:
        """Fresh episodes: ``s`` holds the new state of environments ``rows`` (``len(rows)`` rows), before it is
        written into the batch."""

    def record(self, s: SimState) -> None:
        """Every step, once the rules have judged it (before the reward)."""

    def episode_info(self, s: SimState, done: Tensor, ending: Tensor, truncated: Tensor) -> dict[str, Tensor]:
        """More ``episode/...`` statistics of every row (``ending``: the events that ended the episode this step);
        asked after each step's checks and by ``SimEnv.running_episodes``."""
        return {}


class Observer(Part, abc.ABC):
    """The observation: what the policy and the critic see of a state, and its spec (``SimEnv.observation_spec``).

    ``layout`` names it (``envs.api.LAYOUTS``); the spec names every BEV channel and measurement (``TensorSpec.names``)
    so that a consumer (the trainer's policy, an exported bundle, a deployment adapter) never guesses."""

    layout: str

    @abc.abstractmethod
    def spec(self) -> dict[str, TensorSpec]:
        """Shape, dtype, bounds and names of every observation key (asked once, after :meth:`bind`)."""

    @abc.abstractmethod
    def observe(self, s: SimState, lights: LightFn, speed_limit: Tensor | None = None,
                forecast: ForecastFn | None = None) -> dict[str, Tensor]:
        """The observation of every row of ``s``; ``lights`` tells the colour of the light groups; ``speed_limit``
        [B] (m/s at the ego) when the caller has it already (the step computed it for its checks), else the
        observer looks it up if it needs it; ``forecast`` the route scenarios' scripted vehicle paths, where the
        backend plays them (an observer may ignore it)."""

    def blank_bev(self) -> Tensor:
        """The BEV of an env built with ``bev=False``: zeros as a read-only broadcast view (no memory, nothing
        drawn), made once."""
        if getattr(self, "_blank", None) is None:
            shape = self.spec()[OBS_BEV].shape
            self._blank = torch.zeros((1, *shape), dtype=torch.uint8, device=self.setup.device).expand(
                self.setup.num_envs, *shape)
        return self._blank


# ---------------------------------------------------------------------------------------------- the simulator's own
class RouteStarts(StartSource):
    """The world's route bank: each map by its weight (training) or a fixed assignment (eval split, route files); the
    ego stands at the route's first point, heading along it."""

    def pick(self, rows: Tensor) -> Tensor:
        st = self.setup
        if st.cfg.route_split == "eval" or st.cfg.route_file:
            return self.next_route[rows]  # fixed assignment: row i drives route i (mod the number of routes)
        u = torch.rand(len(rows), generator=st.gen, device=st.device)  # each map by its weight
        return torch.searchsorted(st.world.route_cdf, u, right=True).clamp(max=st.world.num_routes - 1)

    def place(self, s: SimState, rows: Tensor) -> None:
        w, B, dev = self.setup.world, len(rows), self.setup.device
        p0 = w.route_pts[s.route_id, 0]
        d = w.route_pts[s.route_id, 1] - p0
        s.ego_xy, s.ego_yaw = p0, torch.atan2(d[:, 1], d[:, 0])
        s.ego_speed, s.ego_vel_local = torch.zeros(B, device=dev), torch.zeros(B, 2, device=dev)
        s.hist_speed, s.hist_yaw = torch.zeros(B, HISTORY, device=dev), s.ego_yaw.unsqueeze(1).repeat(1, HISTORY)


def gear(speed: Tensor) -> Tensor:
    """The simulator's automatic gear (1 at standstill, up-shifting at ``GEAR_UP_SPEEDS``)."""
    return 1.0 + (speed.unsqueeze(-1) > torch.tensor(GEAR_UP_SPEEDS, device=speed.device)).sum(-1).float()


class KinematicBicycle(EgoDynamics):
    """:func:`envs.sim.dynamics.bicycle_step` with the car of the config; a1 > 0 throttle, a1 < 0 brake."""

    def step(self, s: SimState, action: Tensor) -> None:
        cfg = self.setup.cfg
        steer = action[:, 0]
        throttle = action[:, 1].clamp(min=0.0)
        brake = (-action[:, 1]).clamp(min=0.0)
        s.ego_xy, yaw, s.ego_speed, slip = bicycle_step(torch, cfg, s.ego_xy, s.ego_yaw, s.ego_speed, steer, throttle,
                                                        brake, cfg.dt)
        s.ego_yaw = wrap_angle(yaw)
        s.ego_vel_local = torch.stack((torch.cos(slip), torch.sin(slip)), -1) * s.ego_speed.unsqueeze(-1)
        s.gear = gear(s.ego_speed)
        s.last_action = torch.stack((steer, throttle, brake), -1)


class SimTraffic(ActorSource):
    """IDM vehicles in lane coordinates, crosswalk pedestrians and parked obstacles (:mod:`envs.sim.agents`);
    vehicles far from the ego come back near it once a second."""

    def bind(self, setup: Setup) -> None:
        super().bind(setup)
        self.steps = 0
        cfg = setup.cfg
        self.map_vehicles = agents.vehicles_per_map(setup.world, cfg.num_vehicles, cfg.traffic_density) * cfg.traffic

    def reset(self, s: SimState, rows: Tensor) -> None:
        st, cfg = self.setup, self.setup.cfg
        w, B, dev, g = st.world, len(rows), st.device, st.gen
        veh = agents.spawn_vehicles(w, B, st.num_vehicles, s.ego_xy, w.route_map[s.route_id], g)
        agents.respawn_vehicles(w, veh, s.ego_xy, s.route_id, s.route_idx, g, far=0.0, ahead=(15, 150),
                                min_ego_dist=12.0)
        veh.valid &= self.slots(s.route_id)
        near_idx = (torch.randint(20, 150, (B, st.num_pedestrians), generator=g, device=dev)
                    ).clamp(max=(w.route_n[s.route_id] - 1).unsqueeze(1))
        ped = agents.spawn_pedestrians(w, B, st.num_pedestrians,
                                       w.route_pts[s.route_id.unsqueeze(1).expand_as(near_idx), near_idx], g)
        ped.valid &= cfg.traffic & (torch.arange(st.num_pedestrians, device=dev) < cfg.num_pedestrians)
        statics = agents.spawn_statics(w, s.route_id, s.route_idx, st.num_statics, g)
        statics.valid &= cfg.traffic & (torch.arange(st.num_statics, device=dev) < cfg.num_statics)
        s.veh, s.ped, s.statics = veh, ped, statics

    def step(self, s: SimState, lights: LightFn) -> None:
        # parked obstacles stand at the kerb, off the lanes: lane-following vehicles never need to stop for them (on
        # curves the straight leader corridor would sweep over them and hold vehicles there for good)
        st = self.setup
        veh, bg, scenario_peds = self.background(s), st.background_vehicles, st.scenario_slots[1]
        if not any(st.scenario_slots[:2]):
            obs, scenario = obstacles(s, st.ego_half, include_ego=True, include_statics=False), None
        else:  # the route scenarios' actors apart: they are on few rows (agents.step_vehicles)
            ped = st.num_pedestrians - scenario_peds
            obs = obstacles(s, st.ego_half, include_ego=True, include_statics=False, vehicles=slice(bg),
                            pedestrians=slice(ped))
            scenario = obstacles(s, st.ego_half, include_ego=False, include_statics=False, vehicles=slice(bg, None),
                                 pedestrians=slice(ped, None))
        agents.step_vehicles(st.world, veh, obs, lights, st.cfg, st.gen, scenario)
        self.write_back(s, veh)
        agents.step_pedestrians(st.world, s.ped, st.cfg.dt, st.gen)

    def refresh(self, s: SimState) -> None:
        """Move far-away vehicles back near the ego; density around it changes slowly, so once a second."""
        self.steps += 1
        if self.steps % RESPAWN_EVERY == 0:
            veh = self.background(s)
            agents.respawn_vehicles(self.setup.world, veh, s.ego_xy, s.route_id, s.route_idx, self.setup.gen)
            veh.valid &= self.slots(s.route_id)[:, :veh.valid.shape[1]]
            self.write_back(s, veh)

    def background(self, s: SimState) -> agents.Vehicles:
        """The vehicle slots this part drives: all, or all but the last ones route scenarios own
        (``Setup.scenario_slots``; envs/sim/scenarios.py moves those, here they are only obstacles)."""
        bg = self.setup.background_vehicles
        if bg == self.setup.num_vehicles:
            return s.veh
        return agents.Vehicles(**{f.name: getattr(s.veh, f.name)[:, :bg] for f in dataclasses.fields(s.veh)})

    def write_back(self, s: SimState, veh: agents.Vehicles) -> None:
        """Store what :meth:`background` handed out and the step replaced."""
        if veh is not s.veh:
            for f in dataclasses.fields(veh):
                getattr(s.veh, f.name)[:, :veh.valid.shape[1]] = getattr(veh, f.name)

    def slots(self, route_id: Tensor) -> Tensor:
        """[B, A] bool: the vehicle slots in use on each row's map (its traffic density)."""
        n = self.map_vehicles[self.setup.world.route_map[route_id]]
        return torch.arange(self.setup.num_vehicles, device=self.setup.device) < n.unsqueeze(1)


class LightCycle(LightSource):
    """The simulator's light model: a fixed cycle per junction (green, yellow, all-red per phase) with a random
    offset per junction and episode."""

    def reset(self, s: SimState, rows: Tensor) -> None:
        st, cfg = self.setup, self.setup.cfg
        cycle = 4 * (cfg.light_green + cfg.light_yellow + cfg.light_all_red)
        s.light_offset = torch.rand((len(rows), max(1, st.world.num_junctions)), generator=st.gen,
                                    device=st.device) * cycle

    def state(self, s: SimState, group: Tensor) -> tuple[Tensor, Tensor]:
        return light_state(self.setup.world, group, s.t, s.light_offset, self.setup.cfg)
