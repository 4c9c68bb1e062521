"""The rule-based expert on CARLA: every worker runs the simulator's expert (:mod:`envs.sim.expert`) on its own
state, which mirrors the CARLA world each tick; found by ``carl-eval policy=expert`` through ``make_expert``."""
from __future__ import annotations

from typing import Callable

from torch import Tensor

from envs.carla.vector import CarlaVectorEnv


def make_expert(env: CarlaVectorEnv) -> Callable[..., Tensor]:
    """``policy(obs) -> actions [num_envs, 2]`` (``obs`` is ignored: the expert reads privileged state)."""

    def act(obs: dict[str, Tensor] | None = None) -> Tensor:
        return env.expert_actions()

    return act
