"""Render one episode of the built-in simulator to a GIF (or PNG still) with route and infraction overlays.

    python scripts/render_episode.py --policy expert -o episode.gif [--map Town01 --route-file ROUTES.xml]
    python scripts/render_episode.py --policy random -o random.gif
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
    args = p.parse_args()
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


if __name__ == "__main__":
    main()
