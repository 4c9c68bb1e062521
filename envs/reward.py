"""CaRL's simple reward: the one implementation every backend uses.

Per step ``r = dRC * p_speed * p_ttc * p_comfort * p_lane`` (dRC = route completion gained, in percent, so a
whole route is worth 100), with dRC set to 0 while outside the route lanes, and a terminal penalty subtracted
when a collision or a red-light run ends the episode. The penalty windows (TTC, comfort) are reward state and
live here too, so CARLA, nuPlan and the built-in simulator cannot drift apart. Constants default to CaRL's values
(``../shared/docs/carl-reference.md`` §1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from envs.config import Checks

COMFORT_METRICS = ("lon_acc", "lat_acc", "jerk", "lon_jerk", "yaw_rate", "yaw_acc")


@dataclass
class RewardConfig:
    """Every constant of the reward, CaRL's value as default."""

    terminal_penalty: float = 1.0  # subtracted on collision / red-light termination
    use_outside_lanes: bool = True  # dRC = 0 while outside route lanes
    use_speeding: bool = True
    speeding_margin: float = 2.23  # m/s over the limit at which p_speed reaches 0
    use_ttc: bool = True
    ttc_factor: float = 0.5
    ttc_penalty_ticks: int = 500
    ttc_times: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    use_comfort: bool = True
    comfort_penalty_ticks: int = 500
    # limits: lon acc range, |lat acc|, |jerk|, |lon jerk|, |yaw rate|, |yaw acc|
    comfort_lon_acc: tuple[float, float] = (-20.0, 10.0)
    comfort_lat_acc: float = 9.0
    comfort_jerk: float = 30.0
    comfort_lon_jerk: float = 30.0
    comfort_yaw_rate: float = 1.0
    comfort_yaw_acc: float = 3.0
    use_lane_centre: bool = True
    survival_bonus: float = 0.0  # CaRL: off on CARLA

    def validate(self, prefix: str = "reward") -> None:
        """Raise one :class:`ConfigError` naming every bad constant."""
        checks = Checks()
        for name in ("terminal_penalty", "speeding_margin", "ttc_factor", "survival_bonus"):
            v = getattr(self, name)
            checks.need(v >= 0, f"{prefix}.{name}={v}: must be >= 0")
        checks.need(self.speeding_margin != 0, f"{prefix}.speeding_margin=0: must be > 0 (it divides the speed excess)")
        for name in ("ttc_penalty_ticks", "comfort_penalty_ticks"):
            checks.need(getattr(self, name) >= 0, f"{prefix}.{name}={getattr(self, name)}: must be >= 0")
        checks.need(0 <= self.ttc_factor <= 1, f"{prefix}.ttc_factor={self.ttc_factor}: must be in [0, 1]")
        checks.done()


@dataclass
class RewardInputs:
    """What a backend measures each step (all [B] unless noted)."""

    progress: Tensor  # route completion gained this step, percent
    outside_lanes: Tensor  # bool
    speed: Tensor  # m/s
    speed_limit: Tensor  # m/s
    ttc_violation: Tensor  # bool: a predicted overlap within the TTC horizon
    comfort_violation: Tensor  # bool [B, 6], order COMFORT_METRICS
    lane_offset_ratio: Tensor  # |lateral offset| / (lane width / 2); 0 inside junctions
    terminal_penalty: Tensor  # bool: the episode ends by collision or red light


@dataclass
class RewardState:
    ttc_ticks: Tensor  # [B] int
    comfort_ticks: Tensor  # [B, 6] int

    @classmethod
    def zeros(cls, batch: int, device: torch.device) -> "RewardState":
        return cls(torch.zeros(batch, dtype=torch.int32, device=device),
                   torch.zeros(batch, len(COMFORT_METRICS), dtype=torch.int32, device=device))

    def reset(self, mask: Tensor) -> None:
        self.ttc_ticks.masked_fill_(mask, 0)
        self.comfort_ticks.masked_fill_(mask.unsqueeze(-1), 0)


@dataclass
class RewardTerms:
    reward: Tensor
    factors: dict[str, Tensor] = field(default_factory=dict)  # for logging


def comfort_violations(lon_acc: Tensor, lat_acc: Tensor, jerk: Tensor, lon_jerk: Tensor, yaw_rate: Tensor,
                       yaw_acc: Tensor, cfg: RewardConfig) -> Tensor:
    """The six comfort checks -> bool [B, 6] in COMFORT_METRICS order."""
    lo, hi = cfg.comfort_lon_acc
    return torch.stack((
        (lon_acc < lo) | (lon_acc > hi),
        lat_acc.abs() > cfg.comfort_lat_acc,
        jerk.abs() > cfg.comfort_jerk,
        lon_jerk.abs() > cfg.comfort_lon_jerk,
        yaw_rate.abs() > cfg.comfort_yaw_rate,
        yaw_acc.abs() > cfg.comfort_yaw_acc,
    ), dim=-1)


def compute_reward(inp: RewardInputs, state: RewardState, cfg: RewardConfig) -> RewardTerms:
    """One step of CaRL's reward; updates the penalty windows in ``state`` in place."""
    progress = inp.progress
    if cfg.use_outside_lanes:
        progress = torch.where(inp.outside_lanes, torch.zeros_like(progress), progress)
    one = torch.ones_like(progress)
    p_speed = one
    if cfg.use_speeding:
        excess = (inp.speed - inp.speed_limit).clamp(min=0.0)
        p_speed = (1.0 - excess / cfg.speeding_margin).clamp(min=0.0)
    p_ttc = one
    if cfg.use_ttc:
        state.ttc_ticks.copy_(torch.where(inp.ttc_violation, torch.full_like(state.ttc_ticks, cfg.ttc_penalty_ticks),
                                          (state.ttc_ticks - 1).clamp(min=0)))
        p_ttc = torch.where(state.ttc_ticks > 0, one * cfg.ttc_factor, one)
    p_comfort = one
    if cfg.use_comfort:
        state.comfort_ticks.copy_(torch.where(inp.comfort_violation,
                                              torch.full_like(state.comfort_ticks, cfg.comfort_penalty_ticks),
                                              (state.comfort_ticks - 1).clamp(min=0)))
        active = (state.comfort_ticks > 0).sum(-1).float()
        p_comfort = 1.0 - 0.5 * active / len(COMFORT_METRICS)
    p_lane = (1.0 - inp.lane_offset_ratio.clamp(0.0, 1.0)) if cfg.use_lane_centre else one
    reward = progress * p_speed * p_ttc * p_comfort * p_lane + cfg.survival_bonus
    reward = reward - cfg.terminal_penalty * inp.terminal_penalty.float()
    return RewardTerms(reward, {"speed": p_speed, "ttc": p_ttc, "comfort": p_comfort, "lane": p_lane})
