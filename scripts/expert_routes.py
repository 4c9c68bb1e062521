"""Drive the rule-based expert over procedural routes, Leaderboard routes on CARLA towns, or random routes on any
map file, in the built-in simulator.

Proves routes are drivable (traffic off) and reports the expert's driving score (traffic on). One JSON line per
route, then one summary line per town and overall.

    python scripts/expert_routes.py --routes ../shared/data/carla/routes/longest6_v2.xml [--traffic]
    python scripts/expert_routes.py --procedural 64 [--traffic]
    python scripts/expert_routes.py --map my_map.xodr --random 32 [--traffic]   # also a Town name or a .npz graph
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from carl.eval.loop import run_first_episodes  # noqa: E402
from envs import make_env  # noqa: E402
from envs.maps.routes import parse_leaderboard_xml  # noqa: E402
from envs.sim.expert import Expert  # noqa: E402


def drive(env, max_steps: int) -> list[dict]:
    """First finished episode of every row, driven by the expert."""
    episodes = run_first_episodes(env, Expert(env), max_steps)
    out = []
    for ep in episodes:
        e = {k[8:]: round(v, 4) for k, v in ep.items()}
        e["route"] = env.route_names[int(ep["episode/route_id"])]
        out.append(e)
    return out


def summary(name: str, episodes: list[dict], seconds: float) -> dict:
    n = max(len(episodes), 1)
    ends = Counter(k.split("/", 1)[1] for e in episodes for k, v in e.items() if k.startswith("termination/") and v)
    km = sum(e["km"] for e in episodes)
    per_km = {k.split("/", 1)[1]: round(sum(e[k] for e in episodes) / max(km, 1e-6), 3)
              for k in (episodes[0] if episodes else {}) if k.startswith("infractions/")}
    return {"summary": name, "routes": len(episodes), "driving_score": round(sum(e["driving_score"] for e in episodes) / n, 2),
            "route_completion": round(sum(e["route_completion"] for e in episodes) / n, 2),
            "infraction_score": round(sum(e["infraction_score"] for e in episodes) / n, 3),
            "completed": ends.get("route_completed", 0), "terminations": dict(ends), "km": round(km, 2),
            "infractions_per_km": per_km, "seconds": round(seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--routes", help="Leaderboard route XML (CARLA towns)")
    p.add_argument("--procedural", type=int, default=0, help="number of held-out procedural routes")
    p.add_argument("--map", help="a map (.xodr file, CARLA town name or lane-graph .npz) for --random routes")
    p.add_argument("--random", type=int, default=0, help="number of random routes on --map (the eval route seed)")
    p.add_argument("--traffic", action="store_true")
    p.add_argument("--max-steps", type=int, default=12000)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if not args.routes and not args.procedural and not args.map:
        p.error("give --routes FILE, --procedural N or --map MAP --random N")
    if args.map and args.random < 1:
        p.error("--map needs --random N (N >= 1)")
    options = dict(traffic=args.traffic, bev=False, max_time=1e5 if not args.traffic else 1200.0)
    everything = []
    t_all = time.time()
    if args.routes:
        towns = sorted({town for _, town, _ in parse_leaderboard_xml(args.routes)})
        for town in towns:
            t0 = time.time()
            n = sum(1 for _, t, _ in parse_leaderboard_xml(args.routes) if t == town)
            env = make_env("sim", n, args.device, 0, map=town, route_file=args.routes, num_routes=n, **options)
            episodes = drive(env, args.max_steps)
            for e in episodes:
                print(json.dumps(e), flush=True)
            print(json.dumps(summary(town, episodes, time.time() - t0)), flush=True)
            everything += episodes
    elif args.map:
        env = make_env("sim", args.random, args.device, 0, map=args.map, route_split="eval", num_routes=args.random,
                       **options)
        everything = drive(env, args.max_steps)
        for e in everything:
            print(json.dumps(e), flush=True)
    else:
        env = make_env("sim", args.procedural, args.device, 0, route_split="eval", num_routes=args.procedural, **options)
        everything = drive(env, args.max_steps)
        for e in everything:
            print(json.dumps(e), flush=True)
    print(json.dumps(summary("all", everything, time.time() - t_all)), flush=True)


if __name__ == "__main__":
    main()
