"""The batched environment interface the trainer sees.

Every backend (built-in simulator, CARLA workers, nuPlan) implements :class:`BatchedEnv`: ``B`` environments
stepped in one call, tensors on one device, automatic reset of finished environments. The trainer never imports
a backend; it receives a ``BatchedEnv`` from :func:`envs.make_env`.

Conventions
-----------
* ``reset()`` returns the first observation of every environment.
* ``step(action)`` takes ``action`` of shape ``[B, 2]`` in ``[-1, 1]`` (steer, longitudinal; values outside are
  clipped, NaN raises) and returns a :class:`StepResult`. Where ``terminated | truncated`` is true, the returned
  observation is already the first observation of the next episode (auto-reset), and ``info`` carries the finished
  episode's statistics under ``"episode/..."`` keys (valid only on those rows). If the env was built with
  ``keep_final_obs=True`` the terminal observation is in ``info["final_obs/<key>"]``.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from envs.reward import COMFORT_METRICS


@dataclass(frozen=True)
class TensorSpec:
    """Shape (without the batch dimension), dtype and bounds of one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    low: float = float("-inf")
    high: float = float("inf")


@dataclass
class StepResult:
    obs: dict[str, torch.Tensor]  # key -> [B, *spec.shape]
    reward: torch.Tensor  # [B] float32
    terminated: torch.Tensor  # [B] bool: an episode end the value must not bootstrap through
    truncated: torch.Tensor  # [B] bool: a time/route limit end
    info: dict[str, torch.Tensor]  # key -> [B, ...]


# Keys of the observation dict (CaRL's names).
OBS_BEV = "bev"  # uint8 [C, H, W]
OBS_MEASUREMENTS = "measurements"  # float32 [8], actor and critic
OBS_VALUE_MEASUREMENTS = "value_measurements"  # float32 [10], critic only

# What every backend's observation holds, in order (the simulator's observation code, shared by all of them).
BEV_CHANNELS = ("road", "route", "lane_markings", "vehicles", "pedestrians", "traffic_lights", "stop_sign",
                "speed_signs", "static_objects", "shoulder")
MEASUREMENTS = ("last_steer", "last_throttle", "last_brake", "gear", "speed_x_mps", "speed_y_mps",
                "forward_speed_mps", "speed_limit_mps")
# fractions left of: the episode's time, the time until blocked, the route (points / 100), the TTC penalty window and
# each comfort penalty window
VALUE_MEASUREMENTS = ("time_left", "time_until_blocked", "route_points_left", "ttc_window_left",
                      *(f"comfort_window_left_{m}" for m in COMFORT_METRICS))


class BatchedEnv(abc.ABC):
    """B environments on one device, stepped together, reset automatically."""

    num_envs: int
    device: torch.device
    observation_spec: dict[str, TensorSpec]
    action_spec: TensorSpec = TensorSpec((2,), torch.float32, -1.0, 1.0)

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> dict[str, torch.Tensor]:
        """Start a new episode in every environment; ``seed`` makes the whole batch reproducible."""

    @abc.abstractmethod
    def step(self, action: torch.Tensor) -> StepResult:
        """Advance every environment by one control step (0.1 s)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (servers, processes). The built-in simulator holds none."""

    def state_dict(self) -> dict:
        """Everything needed to continue the same stream of episodes after a resume (RNG states, seeds)."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 - optional hook
        """Restore what :meth:`state_dict` returned."""
