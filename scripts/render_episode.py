"""Render one episode of the built-in simulator to a GIF (or PNG still) with route and infraction overlays.

    python scripts/render_episode.py --policy expert -o episode.gif [--map Town01 --route-file ROUTES.xml]
    python scripts/render_episode.py --policy random -o random.gif
    python scripts/render_episode.py --scenario DynamicObjectCrossing -o doc.png --map Town01 --route-file ROUTES.xml

``--scenario TYPE``: a still of a route scenario of that type in play (the first route of the file that carries one,
the ego placed 40 m before its trigger, driven by the expert until the scenario's actors have acted for
``--scenario-seconds``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs import make_env  # noqa: E402
from envs.sim.expert import Expert  # noqa: E402
from envs.sim.recorder import record_episode  # noqa: E402
from envs.sim.render import write_frames  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", choices=("expert", "random"), default="expert")
    p.add_argument("-o", "--output", default="episode.gif")
    p.add_argument("--map", default="procedural")
    p.add_argument("--route-file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bev-size", type=int, default=256)
    p.add_argument("--no-traffic", action="store_true")
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--scenario", help="a still of this route scenario type in play (needs --route-file)")
    p.add_argument("--scenario-seconds", type=float, default=3.0)
    args = p.parse_args()
    if args.scenario:
        if not args.route_file:
            p.error("--scenario needs --route-file (a Leaderboard route file with <scenarios>)")
        path, info = scenario_still(args.map, args.route_file, args.scenario, args.scenario_seconds, args.output,
                                    args.bev_size, args.seed)
        print(json.dumps({"output": str(path), **info}))
        return
    options = dict(map=args.map, traffic=not args.no_traffic, bev_size=args.bev_size,
                   bev_ego_from_bottom=args.bev_size * 100 // 256, route_split="eval")
    if args.route_file:
        options["route_file"] = args.route_file
    env = make_env("sim", 1, "cpu", args.seed, **options)
    gen = torch.Generator().manual_seed(args.seed)
    policy = Expert(env) if args.policy == "expert" else (lambda obs: torch.rand(1, 2, generator=gen) * 2 - 1)
    frames, stats = record_episode(env, policy, max_steps=args.max_steps)
    path = write_frames(frames, args.output)
    print(json.dumps({"output": str(path), "frames": len(frames), **{k: round(v, 3) for k, v in stats.items()}}))


def scenario_still(town: str, route_file: str, kind: str, seconds: float, output: str, bev_size: int, seed: int
                   ) -> tuple[object, dict]:
    """Place the ego 40 m before the first ``kind`` scenario of the file's routes on ``town``, drive the expert until
    the scenario has been live ``seconds`` (its actors moving), and write that BEV frame."""
    import numpy as np

    from envs.maps.scenarios import SCENARIO_TYPES
    from envs.sim.observation import bev_config
    from envs.sim.recorder import route_overlay
    from envs.sim.render import bev_to_rgb, overlay_text

    if kind not in SCENARIO_TYPES:
        raise SystemExit(f"--scenario {kind}: use one of {', '.join(SCENARIO_TYPES)}")
    options = dict(map=town, route_file=route_file, bev_size=bev_size, bev_ego_from_bottom=bev_size * 100 // 256,
                   rules="leaderboard")
    probe = make_env("sim", 1, "cpu", seed, bev=False, **options)
    tab = probe.world.scn
    hits = []  # (metres since the route's previous scenario, route, table row): the one most on its own
    for r in range(probe.world.num_routes):
        rows = [g for g in tab.route_scn[r].tolist() if g >= 0]
        for j, g in enumerate(rows):
            if SCENARIO_TYPES[int(tab.type[g])] == kind:
                before = int(tab.act_first[rows[j - 1]]) if j else -10**6
                hits.append((int(tab.act_first[g]) - before, r, g))
    if not hits:
        raise SystemExit(f"no {kind} scenario is played on {town}'s routes of {route_file}")
    _, route, g = max(hits)
    env = make_env("sim", 1, "cpu", seed, first_route=route, **options)
    obs, expert = env.reset(), Expert(env)
    s, w = env.state, env.world
    k = max(int(tab.act_first[g]) - 40, 0)
    d = w.route_pts[route, k + 1] - w.route_pts[route, k]
    s.ego_xy[0], s.ego_yaw[0] = w.route_pts[route, k], torch.atan2(d[1], d[0])
    s.ego_speed[0] = 6.0
    s.route_idx[0] = s.crit.dev_idx[0] = k
    obs = env.observe()
    live_since = None
    for _ in range(1200):
        obs = env.step(expert(obs)).obs
        live = bool(((env.state.scn.scn[0] == g) & (env.state.scn.status[0] == 1)).any())
        live_since = (live_since or float(env.state.t[0])) if live else live_since
        if live_since is not None and float(env.state.t[0]) - live_since >= seconds:
            break
    img = route_overlay(bev_to_rgb(obs["bev"][0], bev_config(env.cfg)), env, 0)
    img = np.ascontiguousarray(img.repeat(2, 0).repeat(2, 1))
    img = overlay_text(img, [kind, f"{w.route_names[route]}, {float(env.state.t[0]) - (live_since or 0):.1f} s live"])
    return write_frames([img], output), {"route": w.route_names[route], "scenario_row": g}


if __name__ == "__main__":
    main()
