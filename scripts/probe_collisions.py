"""What a policy's vehicle collisions on longest6 are: one JSON line per collision the Leaderboard rules count.

Drives the benchmark's routes of the given towns once (Leaderboard rules, their scenarios, one traffic seed) and
reads the state before each step in which a row's vehicle-collision count grows: the route, seconds into it, the
scenario types live then, the ego's speed, its action and the ControlLoss noise added to it, and the car hit (the
nearest vehicle that the rules removed: a background car or which scenario's actor, its place x ahead / y left and
heading in the ego's frame, its speed). A summary line counts the collisions by live scenario type and by the kind
of car hit. docs/training.md reads its figures.

    python scripts/probe_collisions.py --policy zoo:towns_vector --towns Town05
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import os
import sys

import torch
from omegaconf import OmegaConf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from carl.eval.benchmarks import resolve_benchmark  # noqa: E402
from carl.eval.loop import make_group_env  # noqa: E402
from carl.eval.policies import resolve_policy  # noqa: E402
from envs.api import SCENARIO_TYPES  # noqa: E402
from envs.sim.infractions import INFRACTIONS  # noqa: E402
from envs.sim.scenarios import LIVE  # noqa: E402

VEHICLE = INFRACTIONS.index("collision_vehicle")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="zoo:towns_vector", help="expert, a checkpoint, a bundle or zoo:<name>")
    p.add_argument("--towns", nargs="+", default=None, help="longest6 towns (default: all six)")
    p.add_argument("--seed", type=int, default=0, help="the evaluation's traffic seed")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bcfg = OmegaConf.to_container(OmegaConf.load(os.path.join(REPO, "conf/benchmark/longest6.yaml")))
    bcfg["towns"] = args.towns
    bench, dev = resolve_benchmark(bcfg), torch.device("cpu")
    policy = resolve_policy(args.policy, dev)
    by_type: collections.Counter[str] = collections.Counter()
    by_car: collections.Counter[str] = collections.Counter()
    for group in bench.groups:
        env = make_group_env(group, group.num_routes, dev, args.seed, policy.env_options())
        try:
            for line in drive(env, policy.make(env, "sim"), args.seed):
                print(json.dumps(line), flush=True)
                by_type.update(line["live"] or ["none"])
                by_car[line["car"]] += 1
        finally:
            env.close()
    print(json.dumps({"policy": args.policy, "collisions": sum(by_car.values()), "by_live_type": dict(by_type),
                      "by_car": dict(by_car)}))


def drive(env, act, seed: int) -> list[dict]:  # noqa: ANN001 - SimEnv, policy
    """Drive every row's route once; one record per counted vehicle collision."""
    obs = env.reset(seed=seed)
    part = env.scenarios
    tab, bg = part.tab, env.setup.background_vehicles
    finished = torch.zeros(env.num_envs, dtype=torch.bool)
    out = []
    for _ in range(env.max_episode_steps):
        s, c = env.state, env.state.scn
        with torch.no_grad():
            action = act(obs)
        live = c.status == LIVE  # [B,K]
        before = (s.veh.valid.clone(), s.veh.xy.clone(), s.veh.yaw.clone(), s.veh.speed.clone(), s.ego_xy.clone(),
                  s.ego_yaw.clone(), s.ego_speed.clone(), s.counts[:, VEHICLE].clone(), s.t.clone(),
                  s.route_id.clone(), live.clone(), c.scn.clone())
        drawn = env.gen.get_state()  # the noise the step is about to add, drawn again by the step itself
        noisy = part.control(_copy_state(s), action)
        env.gen.set_state(drawn)
        res = env.step(action)
        obs = res.obs
        hit = (env.state.counts[:, VEHICLE] > before[7]) & ~finished
        for b in hit.nonzero().flatten().tolist():
            out.append(_record(env, before, b, action[b], noisy[b] - action[b].clamp(-1, 1), bg, tab))
        finished |= (res.terminated | res.truncated).cpu()
        if bool(finished.all()):
            break
    return out


def _copy_state(s):  # noqa: ANN001, ANN202 - SimState
    """A shallow copy whose scenario state is its own (``control`` reassigns its patch and near flags)."""
    t = copy.copy(s)
    t.scn = copy.copy(s.scn)
    return t


def _record(env, before: tuple, b: int, action: torch.Tensor, noise: torch.Tensor, bg: int,  # noqa: ANN001
            tab) -> dict:  # noqa: ANN001 - SimEnv, the scenario table
    """Row ``b``'s collision: the state ``before`` the step, the car the rules removed (or the nearest one)."""
    valid, xy, yaw, speed, ego_xy, ego_yaw, ego_speed, _, t, route_id, live, scn = before
    gone = valid[b] & ~env.state.veh.valid[b]
    rel = xy[b] - ego_xy[b]
    cos, sin = math.cos(float(ego_yaw[b])), math.sin(float(ego_yaw[b]))
    x, y = rel[:, 0] * cos + rel[:, 1] * sin, -rel[:, 0] * sin + rel[:, 1] * cos
    dist = torch.where(gone, rel.norm(dim=-1), torch.full_like(x, math.inf))
    if not bool(gone.any()):  # the rules keep the car (e.g. CaRL's): the nearest one
        dist = torch.where(valid[b], rel.norm(dim=-1), torch.full_like(x, math.inf))
    i = int(dist.argmin())
    heading = math.degrees((float(yaw[b, i] - ego_yaw[b]) + math.pi) % (2 * math.pi) - math.pi)
    types = sorted({SCENARIO_TYPES[int(tab.type[k])] for k in scn[b][live[b]].tolist()})
    return {"route": env.route_names[int(route_id[b])], "t_s": round(float(t[b]), 1), "live": types,
            "ego_mps": round(float(ego_speed[b]), 2), "action": [round(v, 2) for v in action.tolist()],
            "noise": [round(v, 2) for v in noise.tolist()],
            "car": "background" if i < bg else "scenario", "car_x_m": round(float(x[i]), 1),
            "car_y_m": round(float(y[i]), 1), "car_yaw_deg": round(heading), "car_mps": round(float(speed[b, i]), 2)}


if __name__ == "__main__":
    main()
