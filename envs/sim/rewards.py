"""The reward part: the reward of a judged step (``reward.mode``; the rules in :mod:`envs.reward`).

:class:`CarlCarlaReward` is CaRL's CARLA reward from the simulator's own measurements, every backend's default. A
backend that measures other inputs brings its own (CaRL's nuPlan reward: :class:`envs.nuplan.carl_reward
.CarlNuplanReward`); a reward with hard constraints of its own ends those episodes (:meth:`Judgement.end_more`).
"""
from __future__ import annotations

import abc

from torch import Tensor

from envs.reward import RewardInputs, compute_reward
from envs.sim.infractions import HARD, TERMINAL_PENALTY
from envs.sim.parts import Part
from envs.sim.rules import Judgement
from envs.sim.state import SimState


class Reward(Part, abc.ABC):
    """A reward: ``mode`` names it (``RewardConfig.mode``)."""

    mode: str

    def reset(self, s: SimState, rows: Tensor) -> None:
        """Fresh episodes ``s`` (rows ``rows``), after every other part placed them; nothing by default."""

    @abc.abstractmethod
    def reward(self, s: SimState, judged: Judgement) -> Tensor:
        """The reward [B] of the step ``judged``."""

    def episode_info(self, s: SimState, done: Tensor, ending: Tensor, truncated: Tensor) -> dict[str, Tensor]:
        """More ``episode/...`` statistics (e.g. why the reward ended an episode); none by default."""
        return {}


class CarlCarlaReward(Reward):
    """CaRL's CARLA reward (``carl-reference.md`` §1): route completion gained times the soft penalties' factors,
    the terminal penalty on the hard events of :data:`envs.sim.infractions.TERMINAL_PENALTY`."""

    mode = "carl_carla"
    TERMINAL = [HARD.index(k) for k in TERMINAL_PENALTY]

    def reward(self, s: SimState, judged: Judgement) -> Tensor:
        j = judged
        return compute_reward(RewardInputs(
            progress=j.tracking.progress, outside_lanes=j.outside, speed=s.ego_speed,
            speed_limit=j.lane["speed_limit"], ttc_violation=j.ttc, comfort_violation=j.comfort,
            lane_offset_ratio=j.lane["lane_ratio"], terminal_penalty=j.hard[:, self.TERMINAL].any(-1)),
            s.reward_state, self.setup.cfg.reward).reward
