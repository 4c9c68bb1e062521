"""What a policy's vehicle collisions on longest6 are: one JSON line per collision the Leaderboard rules count.

Drives the benchmark's routes of the given towns once (Leaderboard rules, their scenarios, one traffic seed) and
reads the state before each step in which a row's vehicle-collision count grows: the route, seconds into it, the
scenario types live then, the ego's speed, its action, whether the ControlLoss noise was on, and the car hit (the
nearest vehicle that the rules removed: a background car or which scenario's actor, its place x ahead / y left and
heading in the ego's frame, its speed). A summary line counts the collisions by live scenario type and by the kind
of car hit. docs/training.md reads its figures.

    python scripts/probe_collisions.py --policy zoo:towns_vector --towns Town05
"""
from __future__ import annotations

import collections
import json
import math

import torch

from longest6_probe import parse_args, policy_envs  # the script's folder is on sys.path; it adds the repository
from envs.api import SCENARIO_TYPES  # noqa: E402
from envs.sim.geometry import to_local, wrap_angle  # noqa: E402
from envs.sim.infractions import INFRACTIONS  # noqa: E402
from envs.sim.scenarios import LIVE  # noqa: E402

VEHICLE = INFRACTIONS.index("collision_vehicle")


def main() -> None:
    args = parse_args(__doc__)
    by_type: collections.Counter[str] = collections.Counter()
    by_car: collections.Counter[str] = collections.Counter()
    for env, act in policy_envs(args):
        for line in drive(env, act, args.seed):
            print(json.dumps(line), flush=True)
            by_type.update(line["live"] or ["none"])
            by_car[line["car"]] += 1
    print(json.dumps({"policy": args.policy, "collisions": sum(by_car.values()), "by_live_type": dict(by_type),
                      "by_car": dict(by_car)}))


def drive(env, act, seed: int) -> list[dict]:  # noqa: ANN001 - SimEnv, policy
    """Drive every row's route once; one record per counted vehicle collision."""
    obs = env.reset(seed=seed)
    finished = torch.zeros(env.num_envs, dtype=torch.bool)
    out = []
    for _ in range(env.max_episode_steps):
        s = env.state
        with torch.no_grad():
            action = act(obs)
        before = (s.veh.valid.clone(), s.veh.xy.clone(), s.veh.yaw.clone(), s.veh.speed.clone(), s.ego_xy.clone(),
                  s.ego_yaw.clone(), s.ego_speed.clone(), s.t.clone(), s.route_id.clone(), s.scn.status == LIVE,
                  s.scn.scn.clone())
        count = s.counts[:, VEHICLE].clone()
        res = env.step(action)
        obs = res.obs
        hit = (env.state.counts[:, VEHICLE] > count) & ~finished
        for b in hit.nonzero().flatten().tolist():
            out.append(_record(env, before, b, action[b]))
        finished |= (res.terminated | res.truncated).cpu()
        if bool(finished.all()):
            break
    return out


def _record(env, before: tuple, b: int, action: torch.Tensor) -> dict:  # noqa: ANN001 - SimEnv
    """Row ``b``'s collision from the state ``before`` the step: the car the rules removed (or, where they keep it,
    the nearest one) in the ego's frame; whether the ControlLoss noise was on in the step (the ego near a live
    patch: under Leaderboard rules a collision does not end the route, so the flag is still the step's)."""
    valid, xy, yaw, speed, ego_xy, ego_yaw, ego_speed, t, route_id, live, scn = (x[b] for x in before)
    gone = valid & ~env.state.veh.valid[b]
    local = to_local(xy, ego_xy, ego_yaw)
    i = int(torch.where(gone if bool(gone.any()) else valid, local.norm(dim=-1), math.inf).argmin())
    types = sorted({SCENARIO_TYPES[int(env.scenarios.tab.type[k])] for k in scn[live].tolist()})
    return {"route": env.route_names[int(route_id)], "t_s": round(float(t), 1), "live": types,
            "ego_mps": round(float(ego_speed), 2), "action": [round(v, 2) for v in action.tolist()],
            "control_loss_noise": bool(env.state.scn.near[b].any()),
            "car": "background" if i < env.setup.background_vehicles else "scenario",
            "car_x_m": round(float(local[i, 0]), 1), "car_y_m": round(float(local[i, 1]), 1),
            "car_yaw_deg": round(math.degrees(float(wrap_angle(yaw[i] - ego_yaw)))),
            "car_mps": round(float(speed[i]), 2)}


if __name__ == "__main__":
    main()
