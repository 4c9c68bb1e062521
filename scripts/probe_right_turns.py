"""How a policy drives longest6's SignalizedJunctionRightTurn: when it joins the stream, and whether it reacts to it.

Drives the benchmark's routes of the given towns (Leaderboard rules, their scenarios) and reads the state at every
step while a right turn is live. Prints one JSON line per right turn (route, seconds from activation to joining the
stream's lane, speed then, metres clear behind and ahead on the stream's path, whether it ended in a collision and,
if so, the car hit: seconds after joining, the ego's speed, the car's place, heading and speed in the ego's frame) and
a summary line: in the states where the ego stands or creeps (< 3 m/s) before the stream's lane after its light
turned green, the policy's longitudinal action with the observation as it is and with the stream's cars taken out
of it (a policy that ignores the stream gives the same action). docs/training.md reads its figures.

    python scripts/probe_right_turns.py --policy zoo:towns_vector --towns Town03
"""
from __future__ import annotations

import json
import math

import torch

from longest6_probe import parse_args, policy_envs  # the script's folder is on sys.path; it adds the repository
from envs.sim.scenario_world import FLOW_SLOTS, RIGHT  # noqa: E402
from envs.sim.scenarios import LIVE  # noqa: E402

JOIN_M = 2.0  # m: the ego's centre this close to the stream's path has joined it
GREEN_S = 5.0  # s: the ego's light is red this long after activation (scenarios.md §3.3)


def main() -> None:
    args = parse_args(__doc__)
    probes = [drive(env, act, args.seed) for env, act in policy_envs(args)]
    lon = torch.cat(probes)
    summary = {"policy": args.policy, "probe_states": len(lon)}
    if len(lon):
        summary.update(lon_with_stream=round(float(lon[:, 0].mean()), 3),
                       lon_without_stream=round(float(lon[:, 1].mean()), 3),
                       share_differing_by_0_1=round(float((lon[:, 0] - lon[:, 1]).abs().gt(0.1).float().mean()), 3))
    print(json.dumps(summary))


def drive(env, act, seed: int) -> torch.Tensor:  # noqa: ANN001 - SimEnv, policy
    """Drive every row's route once; print each right turn's line; return the probe states' longitudinal actions
    [S, 2] (as observed, and with the stream taken out)."""
    obs = env.reset(seed=seed)
    part = env.scenarios
    tab, v0 = part.tab, part.veh0
    shape = env.state.scn.status.shape  # [B, K]: each row's scenarios
    seen, collided = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
    route = torch.zeros(shape, dtype=torch.long)
    joined = torch.full((*shape, 4), math.nan)  # at joining: s from activation, speed, m clear behind, m clear ahead
    hit = torch.full((*shape, 6), math.nan)  # at its collision: s after joining, ego speed, the car hit (x, y, yaw)
    # in the ego's frame before the step, its speed
    probes = [torch.zeros(0, 2)]
    finished = torch.zeros(env.num_envs, dtype=torch.bool)
    for _ in range(env.max_episode_steps):
        s, c = env.state, env.state.scn
        running = ~finished.unsqueeze(1)
        live = (c.status == LIVE) & (tab.type[c.scn] == RIGHT) & running  # [B,K]
        route = torch.where(live & ~seen, s.route_id.unsqueeze(1), route)
        seen |= live
        collided |= c.collided & seen & running  # the episode's flag, until its row restarts
        path = tab.path[part.group_scenario(c)[:, 0]]  # the flow group's path [B,P,2] (1 m points)
        d, ego_s = (path - s.ego_xy[:, None]).norm(dim=-1).min(-1)
        gap = c.act_s[:, 0] - ego_s.float().unsqueeze(1)  # the stream's cars along its path, from the ego
        alive = c.act_alive[:, 0]
        behind = torch.where(alive & (gap < 0), -gap, torch.full_like(gap, 1e3)).amin(-1)
        ahead = torch.where(alive & (gap >= 0), gap, torch.full_like(gap, 1e3)).amin(-1)
        since = s.t.unsqueeze(1) - c.t_act
        at = torch.stack((s.ego_speed, behind, ahead), -1).unsqueeze(1).expand(*shape, 3)
        joins = live & (d < JOIN_M).unsqueeze(1) & joined[..., 0].isnan()
        joined = torch.where(joins.unsqueeze(-1), torch.cat((since.unsqueeze(-1), at), -1), joined)
        with torch.no_grad():
            action = act(obs)
            waiting = live.any(1) & (torch.where(live, since, -1.0).amax(1) > GREEN_S) & (d > JOIN_M + 1.0) & (
                s.ego_speed < 3.0)
            if bool(waiting.any()):
                shown = s.veh.valid[:, v0:v0 + FLOW_SLOTS].clone()
                s.veh.valid[:, v0:v0 + FLOW_SLOTS] = False
                blind = act(env.observe(s))
                s.veh.valid[:, v0:v0 + FLOW_SLOTS] = shown
                probes.append(torch.stack((action[waiting, 1], blind[waiting, 1]), -1))
        before = (s.veh.valid.clone(), s.veh.xy.clone(), s.veh.yaw.clone(), s.veh.speed.clone(), s.ego_xy.clone(),
                  s.ego_yaw.clone(), s.ego_speed.clone(), c.collided.clone())
        res = env.step(action)
        obs = res.obs
        hit = torch.where((env.state.scn.collided & ~before[7] & live & hit[..., 0].isnan()).unsqueeze(-1),
                          _hit_car(env.state, before, joined, since).unsqueeze(1), hit)
        finished |= (res.terminated | res.truncated).cpu()
        if bool(finished.all()):
            break
    keys = ("joined_s", "speed_mps", "clear_behind_m", "clear_ahead_m")
    hit_keys = ("s_after_joining", "ego_mps", "car_x_m", "car_y_m", "car_yaw_deg", "car_mps")
    for b, k in seen.nonzero().tolist():  # the report, once
        at_join = {key: round(x, 1) for key, x in zip(keys, joined[b, k].tolist())}
        at_hit = {key: round(x, 1) for key, x in zip(hit_keys, hit[b, k].tolist()) if not math.isnan(x)}
        print(json.dumps({"route": env.route_names[int(route[b, k])],
                          **(at_join if not math.isnan(at_join["joined_s"]) else {"joined_s": None}),
                          "collided": bool(collided[b, k]), **({"hit": at_hit} if at_hit else {})}))
    return torch.cat(probes)


def _hit_car(s, before: tuple[torch.Tensor, ...], joined: torch.Tensor,  # noqa: ANN001 - SimState
             since: torch.Tensor) -> torch.Tensor:
    """[B, 6]: seconds after joining (NaN: not joined), the ego's speed and the car the ego hit this step (the
    nearest vehicle the Leaderboard rules removed: valid before, gone after), in the ego's frame before the step
    (x ahead, y left, its heading in degrees relative to the ego's) and its speed; NaN where no car was removed."""
    valid, xy, yaw, speed, ego_xy, ego_yaw, ego_speed, _ = before
    gone = valid & ~s.veh.valid
    rel = xy - ego_xy.unsqueeze(1)
    cos, sin = torch.cos(ego_yaw).unsqueeze(1), torch.sin(ego_yaw).unsqueeze(1)
    x, y = rel[..., 0] * cos + rel[..., 1] * sin, -rel[..., 0] * sin + rel[..., 1] * cos
    dist = torch.where(gone, rel.norm(dim=-1), torch.full_like(x, math.inf))
    i = dist.argmin(1, keepdim=True)
    pick = lambda t: t.gather(1, i).squeeze(1)  # noqa: E731
    heading = torch.rad2deg(torch.remainder(pick(yaw) - ego_yaw + math.pi, 2 * math.pi) - math.pi)
    after = (since - joined[..., 0]).nan_to_num(nan=math.inf).amin(1)  # the earliest-joined live turn
    out = torch.stack((torch.where(torch.isfinite(after), after, torch.full_like(after, math.nan)), ego_speed,
                       pick(x), pick(y), heading, pick(speed)), -1)
    return torch.where(gone.any(1, keepdim=True), out, torch.full_like(out, math.nan))


if __name__ == "__main__":
    main()
