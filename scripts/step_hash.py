"""A fingerprint of the simulator's behaviour: sha256 of every observation, reward, done flag and episode statistic
over N steps of B environments under a fixed seed and a fixed action stream, for each rule set and backend.

A refactoring of the core that must not change behaviour keeps these hashes (same machine, same torch build: the
float results are bit-exact only there). Prints one JSON line per case.

    python scripts/step_hash.py [--steps 150] [--envs 8] [--cases sim_carl sim_leaderboard nuplan_carl ...]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs import make_env  # noqa: E402

SIM = dict(town_seeds=(0, 1), num_routes=32, bev_size=64, bev_ego_from_bottom=24, keep_final_obs=True)


def nuplan_options(root: str, tmp: str, sim: dict | None = None, **extra) -> dict:
    return dict(cache_dir=os.path.join(tmp, "cache"), data_root=root,
                sim={"bev_size": 48, "bev_ego_from_bottom": 18, "keep_final_obs": True, **(sim or {})}, **extra)


def cases(tmp: str) -> dict:
    from envs.nuplan.synthetic import make_synthetic_dataset

    root = str(make_synthetic_dataset(os.path.join(tmp, "data"), num_logs=2))
    return {
        "sim_carl": ("sim", dict(SIM, rules="carl")),
        "sim_leaderboard": ("sim", dict(SIM, rules="leaderboard", route_split="eval")),
        # the route scenarios at longest6's density and mix, on the training and the held-out routes
        "sim_scenarios": ("sim", dict(SIM, scenario_density=7.4)),
        "sim_scenarios_leaderboard": ("sim", dict(SIM, rules="leaderboard", route_split="eval", scenario_density=12.0)),
        # the vector observation (towns_vector's: with path conflicts) beside the same scenarios
        "sim_vector": ("sim", dict(SIM, bev=False, observation="vector", vector={"path_conflicts": True},
                                   scenario_density=7.4)),
        "nuplan_carl": ("nuplan", nuplan_options(root, tmp)),
        "nuplan_eval_reactive": ("nuplan", nuplan_options(root, tmp, {"reward": {"mode": "carl_carla"}},
                                                          route_split="eval", reactive=True, score=True)),
    }


def fingerprint(case: str, name: str, options: dict, steps: int, envs: int) -> dict:
    env = make_env(name, envs, "cpu", 3, **options)
    h = hashlib.sha256()
    g = torch.Generator().manual_seed(11)

    def add(x: torch.Tensor) -> None:
        h.update(x.detach().contiguous().cpu().numpy().tobytes())

    obs = env.reset(seed=5)
    for k in sorted(obs):
        add(obs[k])
    episodes, total = 0, 0.0
    for _ in range(steps):
        action = torch.rand(envs, 2, generator=g) * 2 - 1
        action[:, 1] = action[:, 1] * 0.5 + 0.4  # mostly forward, so routes progress and events happen
        r = env.step(action)
        for k in sorted(r.obs):
            add(r.obs[k])
        add(r.reward), add(r.terminated), add(r.truncated)
        for k in sorted(r.info):
            add(r.info[k])
        episodes += int(r.info["done"].sum())
        total += float(r.reward.sum())
    return {"case": case, "steps": steps, "envs": envs, "episodes": episodes, "reward_sum": round(total, 4),
            "sha256": h.hexdigest()[:16]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--cases", nargs="*")
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        table = cases(tmp)
        for case in a.cases or table:
            name, options = table[case]
            out = fingerprint(case, name, options, a.steps, a.envs)
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
