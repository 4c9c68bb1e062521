"""The record stage: each episode's running statistics (return, infraction counts, metres outside the lanes) and the
``episode/...`` keys of ``info`` (``envs.api``) computed from them."""
from __future__ import annotations

import torch
from torch import Tensor

from envs.metrics.leaderboard import SCENARIO_TIMEOUT_PENALTY
from envs.sim import infractions
from envs.sim.infractions import HARD, INFRACTIONS
from envs.sim.rules import Judgement
from envs.sim.state import SimState
from envs.sim.world import World

TERMINATIONS = HARD + ("route_completed",)


def count(s: SimState, j: Judgement, reward: Tensor) -> None:
    """Add this step to the episode's statistics: the return, the hard events, the soft ones on their rising edge
    (speeding, ttc, comfort, outside the lanes) and the route metres driven outside the lanes."""
    s.ep_return = s.ep_return + reward
    soft = torch.stack((s.ego_speed > j.lane["speed_limit"], j.ttc, j.comfort.any(-1), j.outside), -1)
    rising = soft & ~s.prev_soft
    s.prev_soft = soft
    s.counts = s.counts + torch.cat((j.hard, rising), -1).long()
    travelled = j.tracking.travelled
    s.outside_m = s.outside_m + torch.where(j.outside, travelled, torch.zeros_like(travelled))


def episode_info(w: World, s: SimState, done: Tensor, ending: Tensor, finished: Tensor) -> dict[str, Tensor]:
    """Episode statistics of every row. ``ending``: the events that ended the episode this step; ``finished``: rows
    whose route ended without them (route completed, or the backend's own end such as a log's last frame)."""
    route_len = w.route_len[s.route_id]
    outside_pct = s.outside_m / route_len.clamp(min=1e-3) * 100.0
    score = (infractions.infraction_score(s.counts, outside_pct) * s.crit.ms_factor
             * SCENARIO_TIMEOUT_PENALTY ** s.scn.timeouts.float())
    reason = torch.cat((ending, finished.unsqueeze(-1)), -1)
    first = reason.float().argmax(-1)  # the first reason in TERMINATIONS order
    info = {
        "done": done,
        # copies: finished rows are reset in place right after
        "episode/return": s.ep_return.clone(), "episode/length": s.steps.float(),
        "episode/route_completion": s.rc.clone(), "episode/infraction_score": score,
        "episode/driving_score": (s.rc * score).clamp(min=0.0), "episode/km": route_len * s.rc / 100.0 / 1000.0,
        "episode/route_id": s.route_id.clone(), "episode/outside_lanes_pct": outside_pct,
        "episode/min_speed_factor": s.crit.ms_factor.clone(),
    }
    for i, name in enumerate(INFRACTIONS):
        info[f"episode/infractions/{name}"] = s.counts[:, i].float()
    info["episode/infractions/min_speed"] = s.crit.ms_events.float()
    for i, name in enumerate(TERMINATIONS):
        info[f"episode/termination/{name}"] = ((first == i) & reason.any(-1)).float()
    return info
