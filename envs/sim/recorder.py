"""Record one environment's episode as annotated frames: the colour BEV, the route ahead, speed, reward, infractions.

For people (``scripts/render_episode.py``, evaluation videos of the worst routes); not on the training hot path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import Tensor

from envs.api import episode_stats
from envs.sim.observation import bev_config, render_bev
from envs.sim.bev_draw import world_to_bev
from envs.sim.render import bev_to_rgb, overlay_text

if TYPE_CHECKING:  # the env is what these read, not a dependency of theirs
    from envs.sim.env import SimEnv

ROUTE_COLOUR = np.array((255, 0, 255), np.uint8)


def route_overlay(img: np.ndarray, env: SimEnv, row: int, points: int = 200) -> np.ndarray:
    """Mark the next ``points`` route points of environment ``row`` on its colour BEV."""
    s, w = env.state, env.world
    rid = s.route_id[row]
    k = (s.route_idx[row] + torch.arange(points, device=env.device)).clamp(max=w.route_n[rid] - 1)
    px = world_to_bev(w.route_pts[rid, k].unsqueeze(0), s.ego_xy[row:row + 1], s.ego_yaw[row:row + 1],
                      bev_config(env.cfg))[0].round().long().cpu().numpy()
    h, wd = img.shape[:2]
    ok = (px[:, 0] >= 0) & (px[:, 0] < wd) & (px[:, 1] >= 0) & (px[:, 1] < h)
    out = img.copy()
    out[px[ok, 1], px[ok, 0]] = ROUTE_COLOUR
    return out


def record_episode(env: SimEnv, policy: Callable[[dict[str, Tensor]], Tensor], row: int = 0,
                   max_steps: int = 3000, scale: int = 2) -> tuple[list[np.ndarray], dict[str, float]]:
    """Run ``policy`` on every environment until ``row`` finishes its episode; return its frames and statistics. The
    frames are the observation's BEV, or, for a policy that observes something else (the vector observation), the
    BEV drawn from the state for the picture only."""
    if not env.cfg.bev:
        raise ValueError("recording needs the BEV: create the environment with bev=True")
    obs = env.reset()
    frames: list[np.ndarray] = []
    stats: dict[str, float] = {}
    total = 0.0
    for step in range(max_steps):
        bev = obs["bev"][row] if "bev" in obs else render_bev(env.world, env.state, env.cfg,
                                                              env.light_lookup(env.state))[row]
        img = route_overlay(bev_to_rgb(bev, bev_config(env.cfg)), env, row)
        if scale > 1:
            img = img.repeat(scale, 0).repeat(scale, 1)
        s = env.state
        lines = [f"t {float(s.t[row]):6.1f}s  v {float(s.ego_speed[row]) * 3.6:5.1f} km/h",
                 f"RC {float(s.rc[row]):5.1f}%  return {total:6.2f}"]
        r = env.step(policy(obs))
        total += float(r.reward[row])
        obs = r.obs
        if bool(r.info["done"][row]):
            stats = {k: float(v[row]) for k, v in episode_stats(r.info).items()}
            reason = next(k[12:] for k, v in stats.items() if k.startswith("termination/") and v)
            frames.append(overlay_text(img, lines + [f"END: {reason}", f"DS {stats['driving_score']:.1f}"],
                                       colour=(255, 80, 80) if reason != "route_completed" else (120, 255, 120)))
            break
        frames.append(overlay_text(img, lines))
    return frames, stats
