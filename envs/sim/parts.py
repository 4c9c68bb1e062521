"""The parts a simulator core (:class:`envs.sim.env.SimEnv`) is assembled from, and the built-in simulator's own.

A backend is the core plus its parts (composition, as in Waymax), not a subclass that overrides the step. The core
owns the state layout, the clock, route progress, the infraction checks, the reward, auto-reset and the
observation; the parts decide how the world moves. They are bound to the core they serve (:meth:`Part.bind`: its
world, config, random generator and device) and called at fixed points:

* fresh episodes for rows ``rows``: ``starts.pick`` -> ``starts.place`` -> ``ego.reset`` -> ``actors.reset`` ->
  ``lights.reset`` (the random draws of the built-in simulator follow this order);
* a step: ``ego.step`` -> ``actors.step`` -> the clock advances -> ``lights.step`` -> route progress, infractions,
  reward (``lights.state`` answers light queries throughout) -> ``hook.episode_info`` -> ``hook.end_step`` ->
  auto-reset of finished rows -> ``actors.refresh`` -> the observation (``observer.observe``; ``reset`` ends with
  it too).

Every call is batched over the rows of the state it gets. Parts may keep their own per-row state in an extension of
the state dataclass (``SimEnv(state_type=...)``, e.g. :class:`envs.nuplan.env.NuplanState`), filled in ``reset``.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from envs.api import (BEV_CHANNELS, LAYOUT_CARLA, MEASUREMENTS, OBS_BEV, OBS_MEASUREMENTS, OBS_VALUE_MEASUREMENTS,
                      VALUE_MEASUREMENTS, TensorSpec)
from envs.sim import agents
from envs.sim.dynamics import GEAR_UP_SPEEDS, bicycle_step
from envs.sim.geometry import wrap_angle
from envs.sim.infractions import HISTORY, lane_measures
from envs.sim.observation import measurements, render_bev, value_measurements
from envs.sim.world import light_state

if TYPE_CHECKING:
    from envs.sim.env import SimEnv, SimState

RESPAWN_EVERY = 10  # steps between moves of far-away vehicles back near the ego


class Part:
    """Something the core calls at fixed points of its step; ``env`` is the core, set by :meth:`bind`."""

    env: SimEnv

    def bind(self, env: SimEnv) -> None:
        """Attach the part to the core that calls it (once, when the core is built)."""
        self.env = env


class StartSource(Part, abc.ABC):
    """Where episodes start: the route (scenario) a fresh episode drives, and the ego's place on it."""

    @abc.abstractmethod
    def pick(self, rows: Tensor) -> Tensor:
        """Route ids [len(rows)] for fresh episodes in the environments ``rows``."""

    @abc.abstractmethod
    def place(self, s: SimState, rows: Tensor) -> None:
        """Place the ego of fresh episodes ``s`` (``route_id`` set): ``ego_xy``, ``ego_yaw``, ``ego_speed``,
        ``ego_vel_local``, and the comfort history ``hist_speed``, ``hist_yaw`` it starts with."""


class EgoDynamics(Part, abc.ABC):
    """How an action moves the ego."""

    def reset(self, s: SimState, rows: Tensor) -> None:
        """Initialise the model's own state of fresh episodes ``s`` (after the ego was placed); none by default."""

    @abc.abstractmethod
    def step(self, s: SimState, action: Tensor) -> None:
        """Advance the ego by ``cfg.dt`` under ``action`` [B, 2] (steer, longitudinal; clipped to [-1, 1]): set
        ``ego_xy``, ``ego_yaw``, ``ego_speed``, ``ego_vel_local``, ``last_action`` and, where the model has a
        gearbox, ``gear`` (1 otherwise)."""


class ActorSource(Part, abc.ABC):
    """The other road users: ``s.veh``, ``s.ped`` and ``s.statics`` (padded to the core's slot counts)."""

    @abc.abstractmethod
    def reset(self, s: SimState, rows: Tensor) -> None:
        """The actors of fresh episodes ``s`` (ego placed, light offsets not yet drawn)."""

    @abc.abstractmethod
    def step(self, s: SimState) -> None:
        """Advance the actors by ``cfg.dt`` (after the ego moved, before the clock advances)."""

    def refresh(self, s: SimState) -> None:
        """Last change before the observation is drawn, after finished rows restarted; nothing by default."""


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


class StepHook(Part):
    """Optional additions of a backend to each episode start and step; every method does nothing by default."""

    def episode_info(self, s: SimState, done: Tensor, ending: Tensor, truncated: Tensor) -> dict[str, Tensor]:
        """More ``episode/...`` statistics of every row (``ending``: the events that ended the episode this step);
        asked after each step's checks and by ``SimEnv.running_episodes``."""
        return {}

    def start(self, s: SimState, rows: Tensor) -> None:
        """Fresh episodes: ``s`` holds the new state of environments ``rows`` (``len(rows)`` rows), before it is
        written into the batch."""

    def ends(self, s: SimState) -> Tensor | None:
        """Rows whose episode ends this step by the backend's own clock (e.g. a logged scenario's last frame), before
        the step's statistics are taken; such ends are truncations. None: no such rule."""
        return None

    def reward(self, s: SimState) -> tuple[Tensor, Tensor] | None:
        """A backend's own reward of this step and the rows its hard constraints end (terminations), in place of the
        core's CaRL (CARLA) reward; None: the core's reward."""
        return None

    def end_step(self, s: SimState, terminated: Tensor, truncated: Tensor, info: dict[str, Tensor]) -> Tensor:
        """The last word on a step before finished rows restart: may add to ``info`` and end more episodes (returns
        ``truncated``)."""
        return truncated


# ---------------------------------------------------------------------------------------------- the simulator's own
class RouteStarts(StartSource):
    """The world's route bank: each map by its weight (training) or a fixed assignment (eval split, route files); the
    ego stands at the route's first point, heading along it."""

    def pick(self, rows: Tensor) -> Tensor:
        env = self.env
        if env.cfg.route_split == "eval" or env.cfg.route_file:
            return env.next_route[rows]  # fixed assignment: row i drives route i (mod the number of routes)
        u = torch.rand(len(rows), generator=env.gen, device=env.device)  # each map by its weight
        return torch.searchsorted(env.world.route_cdf, u, right=True).clamp(max=env.world.num_routes - 1)

    def place(self, s: SimState, rows: Tensor) -> None:
        w, B, dev = self.env.world, len(rows), self.env.device
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
        cfg = self.env.cfg
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

    def bind(self, env: SimEnv) -> None:
        super().bind(env)
        self.steps = 0

    def reset(self, s: SimState, rows: Tensor) -> None:
        env, cfg = self.env, self.env.cfg
        w, B, dev, g = env.world, len(rows), env.device, env.gen
        veh = agents.spawn_vehicles(w, B, env.num_vehicles, s.ego_xy, w.route_map[s.route_id], g)
        agents.respawn_vehicles(w, veh, s.ego_xy, s.route_id, s.route_idx, g, far=0.0, ahead=(15, 150),
                                min_ego_dist=12.0)
        veh.valid &= self.slots(s.route_id)
        near_idx = (torch.randint(20, 150, (B, env.num_pedestrians), generator=g, device=dev)
                    ).clamp(max=(w.route_n[s.route_id] - 1).unsqueeze(1))
        ped = agents.spawn_pedestrians(w, B, env.num_pedestrians,
                                       w.route_pts[s.route_id.unsqueeze(1).expand_as(near_idx), near_idx], g)
        ped.valid &= cfg.traffic & (torch.arange(env.num_pedestrians, device=dev) < cfg.num_pedestrians)
        st = agents.spawn_statics(w, s.route_id, s.route_idx, env.num_statics, g)
        st.valid &= cfg.traffic & (torch.arange(env.num_statics, device=dev) < cfg.num_statics)
        s.veh, s.ped, s.statics = veh, ped, st

    def step(self, s: SimState) -> None:
        # parked obstacles stand at the kerb, off the lanes: lane-following vehicles never need to stop for them (on
        # curves the straight leader corridor would sweep over them and hold vehicles there for good)
        env = self.env
        agents.step_vehicles(env.world, s.veh, env.obstacles(s, include_ego=True, include_statics=False),
                             lambda g: env.lights.state(s, g), env.cfg, env.gen)
        agents.step_pedestrians(env.world, s.ped, env.cfg.dt, env.gen)

    def refresh(self, s: SimState) -> None:
        """Move far-away vehicles back near the ego; density around it changes slowly, so once a second."""
        self.steps += 1
        if self.steps % RESPAWN_EVERY == 0:
            agents.respawn_vehicles(self.env.world, s.veh, s.ego_xy, s.route_id, s.route_idx, self.env.gen)
            s.veh.valid &= self.slots(s.route_id)

    def slots(self, route_id: Tensor) -> Tensor:
        """[B, A] bool: the vehicle slots in use on each row's map (its traffic density, ``env.map_vehicles``)."""
        env = self.env
        n = env.map_vehicles[env.world.route_map[route_id]]
        return torch.arange(env.num_vehicles, device=env.device) < n.unsqueeze(1)


class LightCycle(LightSource):
    """The simulator's light model: a fixed cycle per junction (green, yellow, all-red per phase) with a random
    offset per junction and episode."""

    def reset(self, s: SimState, rows: Tensor) -> None:
        env, cfg = self.env, self.env.cfg
        cycle = 4 * (cfg.light_green + cfg.light_yellow + cfg.light_all_red)
        s.light_offset = torch.rand((len(rows), max(1, env.world.num_junctions)), generator=env.gen,
                                    device=env.device) * cycle

    def state(self, s: SimState, group: Tensor) -> tuple[Tensor, Tensor]:
        return light_state(self.env.world, group, s.t, s.light_offset, self.env.cfg)


# ---------------------------------------------------------------------------------------------- what the policy sees
class Observer(Part, abc.ABC):
    """The observation: what the policy and the critic see of a state, and its spec (``SimEnv.observation_spec``).

    ``layout`` names it (``envs.api.LAYOUTS``); the spec names every BEV channel and measurement (``TensorSpec.names``)
    so that a consumer (the trainer's policy, an exported bundle, a deployment adapter) never guesses."""

    layout: str

    @abc.abstractmethod
    def spec(self) -> dict[str, TensorSpec]:
        """Shape, dtype, bounds and names of every observation key (asked once, after :meth:`bind`)."""

    @abc.abstractmethod
    def observe(self, s: SimState, speed_limit: Tensor | None = None) -> dict[str, Tensor]:
        """The observation of every row of ``s``; ``speed_limit`` [B] (m/s at the ego) when the caller has it
        already (the step computed it for its checks), else the observer looks it up if it needs it."""

    def blank_bev(self) -> Tensor:
        """The BEV of an env built with ``bev=False``: zeros as a broadcast view (no memory, nothing drawn)."""
        env = self.env
        spec = env.observation_spec[OBS_BEV]
        return torch.zeros((1, *spec.shape), dtype=torch.uint8, device=env.device).expand(env.num_envs, *spec.shape)


class CarlaObserver(Observer):
    """CaRL's CARLA observation (``carl-reference.md`` §2; :mod:`envs.sim.observation`): the 10-channel BEV, 8
    measurements and 10 critic values. Every backend's default."""

    layout = LAYOUT_CARLA

    def spec(self) -> dict[str, TensorSpec]:
        cfg = self.env.cfg
        bev = (len(BEV_CHANNELS), cfg.bev_size, cfg.bev_size)
        return {OBS_BEV: TensorSpec(bev, torch.uint8, 0, 255, BEV_CHANNELS),
                OBS_MEASUREMENTS: TensorSpec((len(MEASUREMENTS),), torch.float32, names=MEASUREMENTS),
                OBS_VALUE_MEASUREMENTS: TensorSpec((len(VALUE_MEASUREMENTS),), torch.float32,
                                                   names=VALUE_MEASUREMENTS)}

    def observe(self, s: SimState, speed_limit: Tensor | None = None) -> dict[str, Tensor]:
        env = self.env
        if speed_limit is None:
            speed_limit = lane_measures(env.world, s.ego_xy, s.ego_yaw)["speed_limit"]
        obs = {OBS_MEASUREMENTS: measurements(s, speed_limit),
               OBS_VALUE_MEASUREMENTS: value_measurements(env.world, s, env.cfg, env.cfg.reward)}
        if env.cfg.bev:
            obs[OBS_BEV] = render_bev(env.world, s, env.cfg, lambda group: env.lights.state(s, group))
        else:
            obs[OBS_BEV] = self.blank_bev()
        return obs
