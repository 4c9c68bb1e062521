"""How a policy drives longest6's SignalizedJunctionRightTurn: when it joins the stream, and whether it reacts to it.

Drives the benchmark's routes of the given towns (Leaderboard rules, their scenarios) and reads the state at every
step while a right turn is live. Prints one JSON line per right turn (route, seconds from activation to joining the
stream's lane, speed then, metres clear behind and ahead on the stream's path, whether it ended in a collision) and
a summary line: in the states where the ego stands or creeps (< 3 m/s) before the stream's lane after its light
turned green, the policy's longitudinal action with the observation as it is and with the stream's cars taken out
of it (a policy that ignores the stream gives the same action). docs/training.md reads its figures.

    python scripts/probe_right_turns.py --policy zoo:towns_vector --towns Town03
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from carl.eval.benchmarks import resolve_benchmark  # noqa: E402
from carl.eval.loop import make_group_env  # noqa: E402
from carl.eval.policies import resolve_policy  # noqa: E402
from envs.sim.scenario_world import FLOW_SLOTS, RIGHT  # noqa: E402
from envs.sim.scenarios import LIVE  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOIN_M = 2.0  # m: the ego's centre this close to the stream's path has joined it
GREEN_S = 5.0  # s: the ego's light is red this long after activation (scenarios.md §3.3)


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
    probes: list[tuple[float, float]] = []
    for group in bench.groups:
        env = make_group_env(group, group.num_routes, dev, args.seed, policy.env_options())
        try:
            probes += drive(env, policy.make(env, "sim"), args.seed)
        finally:
            env.close()
    with_, without = (torch.tensor([x[i] for x in probes]) for i in (0, 1))
    print(json.dumps({"policy": args.policy, "probe_states": len(probes),
                      "lon_with_stream": round(float(with_.mean()), 3) if probes else None,
                      "lon_without_stream": round(float(without.mean()), 3) if probes else None,
                      "share_differing_by_0.1": round(float((with_ - without).abs().gt(0.1).float().mean()), 3)
                      if probes else None}))


def drive(env, act, seed: int) -> list[tuple[float, float]]:  # noqa: ANN001 - SimEnv, policy
    """Drive every row's route once; print each right turn's line; return the probe states' (lon, lon without)."""
    obs = env.reset(seed=seed)
    part = env.scenarios
    tab, v0 = part.tab, part.veh0
    turns: dict[tuple[int, int], dict] = {}
    probes = []
    finished = torch.zeros(env.num_envs, dtype=torch.bool)
    for _ in range(env.max_episode_steps):
        s, c = env.state, env.state.scn
        live = (c.status == LIVE) & (tab.type[c.scn] == RIGHT) & ~finished.unsqueeze(1)  # [B,K]
        path = tab.path[part._group_scenario(c)[:, 0]]  # the flow group's path [B,P,2] (1 m points)
        d, ego_s = (path - s.ego_xy[:, None]).norm(dim=-1).min(-1)
        cars, alive = c.act_s[:, 0], c.act_alive[:, 0]
        gap = cars - ego_s.float().unsqueeze(1)
        behind = torch.where(alive & (gap < 0), -gap, torch.full_like(gap, 1e3)).amin(-1)
        ahead = torch.where(alive & (gap >= 0), gap, torch.full_like(gap, 1e3)).amin(-1)
        since = s.t.unsqueeze(1) - c.t_act
        with torch.no_grad():
            action = act(obs)
            waiting = live.any(1) & (torch.where(live, since, -1.0).amax(1) > GREEN_S) & (d > JOIN_M + 1.0) & (
                s.ego_speed < 3.0)
            if bool(waiting.any()):
                shown = s.veh.valid[:, v0:v0 + FLOW_SLOTS].clone()
                s.veh.valid[:, v0:v0 + FLOW_SLOTS] = False
                blind = act(env.observe(s))
                s.veh.valid[:, v0:v0 + FLOW_SLOTS] = shown
                probes += [(float(action[b, 1]), float(blind[b, 1])) for b in waiting.nonzero()[:, 0].tolist()]
        for b, k in live.nonzero().tolist():
            turn = turns.setdefault((b, k), {"route": env.route_names[int(s.route_id[b])], "joined_s": None})
            if turn["joined_s"] is None and float(d[b]) < JOIN_M:
                turn.update(joined_s=round(float(since[b, k]), 1), speed_mps=round(float(s.ego_speed[b]), 1),
                            clear_behind_m=round(float(behind[b]), 1), clear_ahead_m=round(float(ahead[b]), 1))
        for (b, k), turn in turns.items():  # the episode's flag, until its row finishes (and restarts)
            if not finished[b]:
                turn["collided"] = bool(c.collided[b, k])
        res = env.step(action)
        obs = res.obs
        finished |= (res.terminated | res.truncated).cpu()
        if bool(finished.all()):
            break
    for turn in turns.values():
        print(json.dumps(turn))
    return probes


if __name__ == "__main__":
    main()
