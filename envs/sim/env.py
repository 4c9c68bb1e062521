"""The simulator core: ``B`` environments stepped in one call on one torch device.

A step is six named stages over the batched state (:mod:`envs.sim.state`), each done by a part or a short
function: move (ego, actors, clock, lights, route scenarios) -> judge (:mod:`envs.sim.rules`: route progress, infractions, ends) ->
reward (:mod:`envs.sim.rewards`) -> record (:mod:`envs.sim.record`: episode statistics) -> reset (finished rows
start again) -> observe (the observer part). Every stage is batched; nothing loops over environments or actors.
Which parts fill the stages is the backend's choice: by default the built-in simulator's (kinematic bicycle, IDM
traffic, light cycle, CaRL's CARLA observation and reward); the CARLA and nuPlan backends assemble their own.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from envs.api import FINAL_OBS, BatchedEnv, StepResult, TensorSpec
from envs.config import ConfigError, from_dict
from envs.reward import RewardState
from envs.sim import record
from envs.sim.config import SimConfig
from envs.sim.criteria import CriteriaState
from envs.sim.infractions import HARD, INFRACTIONS
from envs.sim.observation import CarlaObserver
from envs.sim.parts import (ActorSource, EgoDynamics, KinematicBicycle, LightCycle, LightSource, Metrics, Observer,
                            RouteStarts, SimTraffic, StartSource)
from envs.sim.rewards import CarlCarlaReward, Reward
from envs.sim.rules import RULE_SETS, Rules, Tracking
from envs.sim.scenarios import RouteScenarios
from envs.sim.state import Setup, SimState, assign_rows
from envs.sim.vector_obs import VectorObserver
from envs.sim.world import LightFn, World, load_world


class SimEnv(BatchedEnv):
    """CaRL's task on the simulator core, assembled from parts (:mod:`envs.sim.parts`); the defaults are the
    built-in simulator's (``docs/simulator.md``: the model and its limits).

    ``rules``: the rule set (default the one ``cfg.rules`` names, :data:`envs.sim.rules.RULE_SETS`); ``reward``:
    the reward (default CaRL's CARLA reward; its ``mode`` must be ``cfg.reward.mode``); ``observer``: the
    observation (default CaRL's CARLA one); ``metrics``: more episode statistics; ``state_type``: the state
    dataclass (an extension of :class:`SimState` carries the parts' own per-row state); ``data``: the backend's own
    data, for its users (nuPlan's logs, CARLA's session)."""

    def __init__(self, cfg: SimConfig, num_envs: int, device: str | torch.device = "cpu", seed: int = 0,
                 world: World | None = None, *, starts: StartSource | None = None,
                 ego: EgoDynamics | None = None, actors: ActorSource | None = None, lights: LightSource | None = None,
                 rules: Rules | None = None, reward: Reward | None = None, observer: Observer | None = None,
                 metrics: tuple[Metrics, ...] = (), scenarios: RouteScenarios | None = None, state_type: type[SimState] = SimState, data: object = None):
        if num_envs < 1:
            raise ValueError(f"num_envs={num_envs}: need at least one environment")
        cfg = cfg.validate()
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device)
        self.seed = seed
        self.gen.manual_seed(seed)
        world = world if world is not None else load_world(cfg, self.device)
        self.setup = Setup.build(cfg, world, num_envs, self.device, self.gen)  # what every part reads
        self.starts = starts if starts is not None else RouteStarts()
        self.ego = ego if ego is not None else KinematicBicycle()
        self.actors = actors if actors is not None else SimTraffic()
        self.lights = lights if lights is not None else LightCycle()
        self.rules = rules if rules is not None else RULE_SETS[cfg.rules]()
        self.reward = reward if reward is not None else CarlCarlaReward()
        if observer is None:
            observer = VectorObserver() if cfg.observation == "vector" else CarlaObserver()
        elif cfg.observation == "vector" and not isinstance(observer, VectorObserver):
            raise ConfigError(f"env.options.observation=vector: this backend observes with {type(observer).__name__} "
                              "and cannot build the vector observation; use env.options.observation=bev")
        self.observer = observer
        self.metrics = tuple(metrics)
        self.scenarios = scenarios if scenarios is not None else RouteScenarios()
        if cfg.reward.mode != self.reward.mode:
            raise ConfigError(f"reward.mode={cfg.reward.mode!r} needs inputs this backend does not measure (CaRL's "
                              f"nuPlan reward: env=nuplan); use reward.mode={self.reward.mode} here")
        for part in (self.starts, self.ego, self.actors, self.scenarios, self.lights, self.rules, self.reward,
                     self.observer, *self.metrics):
            part.bind(self.setup)
        self.observation_spec = self.observer.spec()
        self.action_spec = TensorSpec((2,), torch.float32, -1.0, 1.0, self.ego.action_names)
        self.state_type, self.data = state_type, data
        self.state: SimState | None = None

    @property
    def cfg(self) -> SimConfig:
        return self.setup.cfg

    @property
    def world(self) -> World:
        return self.setup.world

    @property
    def control_dt(self) -> float:
        return self.cfg.dt

    @property
    def ego_half(self) -> Tensor:
        """[B, 2] the ego's half length and half width."""
        return self.setup.ego_half

    # ------------------------------------------------------------------ episode starts
    def initial_state(self, rows: Tensor) -> SimState:
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
            prev_soft=torch.zeros(B, 4, dtype=torch.bool, device=dev), crit=CriteriaState.zeros(B, dev), scn=None)
        self.starts.place(s, rows)
        for part in (self.ego, self.actors, self.scenarios, self.lights, self.reward, *self.metrics):
            part.reset(s, rows)
        return s

    def reset(self, seed: int | None = None) -> dict[str, Tensor]:
        if seed is not None:
            self.seed = seed
            self.gen.manual_seed(seed)
        self.starts.restart()
        self.state = self.initial_state(torch.arange(self.num_envs, device=self.device))
        self.starts.advance(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))
        return self.observe(self.state)

    # ------------------------------------------------------------------ one step
    def step(self, action: Tensor) -> StepResult:
        """move -> judge -> reward -> record -> reset -> observe (see the module docstring)."""
        action, s = self.checked_action(action), self.state
        self.ego.step(s, self.scenarios.control(s, action))
        self.actors.step(s, self.light_lookup(s))
        tracked = self.follow(s)
        self.scenarios.step(s)  # after the route progress, as the Leaderboard's triggerer
        judged = self.rules.judge(s, tracked)
        reward = self.reward.reward(s, judged)
        record.count(s, judged, reward)  # before the scenarios', which charge this step's collisions to a live one
        self.scenarios.record(s)
        for m in self.metrics:
            m.record(s)
        done = judged.terminated | judged.truncated
        info = self.episode_info(s, done, judged.ending, judged.truncated, judged.aborted)
        if self.cfg.keep_final_obs:
            info.update({FINAL_OBS + k: v for k, v in self.observe(s, judged.lane["speed_limit"]).items()})
        self.restart_finished(s, done)
        return StepResult(self.observe(s), reward, judged.terminated, judged.truncated, info)

    def checked_action(self, action: Tensor) -> Tensor:
        """The action as a float tensor on the env's device, clipped to [-1, 1] (the documented clip)."""
        if self.state is None:
            raise RuntimeError("call reset() before step()")
        action = torch.as_tensor(action, device=self.device, dtype=torch.float32)
        if action.shape != (self.num_envs, 2):
            raise ValueError(f"action has shape {tuple(action.shape)}; expected ({self.num_envs}, 2) "
                             "(steer, longitudinal) in [-1, 1]")
        if torch.isnan(action).any():
            rows = torch.nonzero(torch.isnan(action).any(1)).flatten().tolist()[:8]
            raise ValueError(f"action contains NaN in environments {rows}; actions must be finite in [-1, 1]")
        return action.clamp(-1.0, 1.0)

    def follow(self, s: SimState) -> Tracking:
        """The tracking stage, for a state whose ego and actors have moved (by this env's parts, or by an outside
        simulator the Leaderboard agent mirrors): the clock, the lights, the route progress, the stop lines, the
        blocked timer and the comfort history."""
        s.t = s.t + self.cfg.dt
        s.steps = s.steps + 1
        self.lights.step(s)
        return self.rules.track(s, self.light_lookup(s))

    def light_lookup(self, s: SimState) -> LightFn:
        """The colour of the light groups in state ``s``: the light part's answer, with the live scenarios'
        overrides."""
        return lambda group: self.scenarios.lights(s, group, *self.lights.state(s, group))

    def episode_info(self, s: SimState, done: Tensor, ending: Tensor, truncated: Tensor,
                     aborted: Tensor | None = None) -> dict[str, Tensor]:
        """The record stage's ``info``: the core's episode statistics, then the metrics' and the reward's own.
        ``aborted`` rows (cut for no driving reason) get no termination reason."""
        finished = truncated if aborted is None else truncated & ~aborted
        info = record.episode_info(self.world, s, done, ending, finished)
        for part in (*self.metrics, self.reward):
            info.update(part.episode_info(s, done, ending, truncated))
        info.update(self.scenarios.episode_info(s))
        return info

    def restart_finished(self, s: SimState, done: Tensor) -> None:
        """The reset stage: finished rows start a new episode; the traffic around the others stays alive."""
        if bool(done.any()):  # one host sync; skips building fresh episodes on most steps
            rows = torch.nonzero(done).flatten()
            assign_rows(s, rows, self.initial_state(rows))
            self.starts.advance(done)
        self.actors.refresh(s)
        self.scenarios.refresh(s)

    def observe(self, s: SimState | None = None, speed_limit: Tensor | None = None) -> dict[str, Tensor]:
        """The observation of state ``s`` (default the env's); ``speed_limit`` [B] when known already."""
        s = self.state if s is None else s
        forecast = (lambda taus: self.scenarios.vehicle_forecast(s, taus)) if self.scenarios.on else None
        return self.observer.observe(s, self.light_lookup(s), speed_limit, forecast)

    def running_episodes(self) -> dict[str, Tensor]:
        """``episode/...`` statistics of every row's episode as it stands now (evaluation reports routes still
        running at its step limit instead of dropping them)."""
        if self.state is None:
            raise RuntimeError("call reset() before running_episodes()")
        none = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return self.episode_info(self.state, none, none.unsqueeze(1).expand(-1, len(HARD)), none)

    @property
    def max_episode_steps(self) -> int:
        """Steps after which every episode has ended by the rules: CaRL's ``max_time``, or under Leaderboard rules the
        longest route's timeout at its lowest speed limit (300 s + length / (10 % of the limit))."""
        return math.ceil(self.rules.max_seconds() / self.cfg.dt) + 10

    def close(self) -> None:
        """Release what the parts hold outside this process (a CARLA server's actors and connection)."""
        try:
            self.scenarios.close()
        finally:
            self.actors.close()

    # ------------------------------------------------------------------ resume support
    def state_dict(self) -> dict:
        return {"seed": self.seed, "generator": self.gen.get_state(), "next_route": self.starts.next_route.cpu()}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        self.gen.set_state(state["generator"])
        self.starts.next_route = state["next_route"].to(self.device)

    @property
    def route_names(self) -> list[str]:
        return self.world.route_names

    @property
    def route_lengths(self) -> list[float]:
        """Length in metres of every route of the world, by route id."""
        return self.world.route_len.tolist()


def make_sim_env(num_envs: int, device: str | torch.device = "cpu", seed: int = 0, **options: Any) -> SimEnv:
    """``envs.make_env("sim", ...)``: the built-in simulator with ``options`` (see :class:`SimConfig`)."""
    return SimEnv(from_dict(SimConfig, options, "env.options").validate(), num_envs, device, seed)
