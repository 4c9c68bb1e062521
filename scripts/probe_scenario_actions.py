"""How a policy's actions differ from the expert's while a scenario type is live: one JSON line per route group.

Drives the benchmark's routes of the given towns once with the policy (Leaderboard rules, their scenarios, one traffic
seed; ``--training N``: N rows of the training env of ``--preset`` instead, whose random routes carry randomly placed
scenarios) and, in every step where a scenario of ``--type`` is live on a row, asks the rule-based expert for its action
in the same state, as the cloning teacher does in training. It counts, for the longitudinal action (throttle > 0,
brake < 0; ``--margin`` either side of 0 is "neither"), the states where the expert brakes and the policy's mean
action drives on, and the other way round, with the policy's Beta spread there (its standard deviation in action
units, and the share of U-shaped Betas, alpha and beta both < 1, whose mean lies between two likelier ends).
docs/training.md reads its figures (a disagreement there is not by itself a collision: the expert brakes early).

    python scripts/probe_scenario_actions.py --policy /tmp/runs/pl_s1/last.pt --type SignalizedJunctionLeftTurn
    python scripts/probe_scenario_actions.py --policy /tmp/runs/pl_s1/last.pt --training 256 --steps 600
"""
from __future__ import annotations

import collections
import json
import sys

import torch

import longest6_probe  # the script's folder is on sys.path; it adds the repository
from carl.cli import load_config  # noqa: E402
from carl.eval.policies import resolve_policy  # noqa: E402
from carl.train import build_env  # noqa: E402
import envs  # noqa: E402
from envs.api import SCENARIO_TYPES  # noqa: E402
from envs.sim.scenarios import LIVE  # noqa: E402


def main() -> None:
    args = longest6_probe.parse_args(__doc__, extra=_options)
    if args.type not in SCENARIO_TYPES:
        sys.exit(f"--type {args.type}: not a scenario type; use one of {', '.join(SCENARIO_TYPES)}")
    kind = SCENARIO_TYPES.index(args.type)
    if args.training:
        cfg = load_config("train", [f"+experiment={args.preset}"])
        env = build_env(cfg, args.training, torch.device("cpu"), args.seed)
        runs = [(f"training:{args.preset}", env, resolve_policy(args.policy, torch.device("cpu")).make(env, "sim"))]
    else:
        runs = longest6_probe.policy_groups(args)
    total: collections.Counter = collections.Counter()
    for name, env, policy in runs:
        if not hasattr(policy, "distribution"):
            sys.exit(f"--policy {args.policy}: a learned policy (checkpoint, bundle or zoo:<name>) is needed: the "
                     "probe reads its Beta distribution")
        counts = drive(env, policy, kind, args)
        total.update(counts)
        print(json.dumps({"routes": name, **summary(counts)}), flush=True)
    print(json.dumps({"policy": args.policy, "type": args.type, "all": True, **summary(total)}))


def _options(p) -> None:  # noqa: ANN001 - argparse.ArgumentParser
    p.add_argument("--type", default="SignalizedJunctionLeftTurn", help="the scenario type whose live steps count")
    p.add_argument("--margin", type=float, default=0.1, help="|longitudinal action| below this is neither")
    p.add_argument("--training", type=int, default=0, help="N rows of the training env instead of longest6")
    p.add_argument("--preset", default="towns_vector_clone", help="with --training: the preset whose env to build")
    p.add_argument("--steps", type=int, default=0, help="at most this many steps per env (0: the episode limit)")


def summary(v: collections.Counter) -> dict:
    """The counts of :func:`drive` (summed over any number of envs) as the JSON line's fields."""
    n = max(v["states"], 1)
    return {"states": int(v["states"]), "expert_brakes": int(v["expert_brakes"]),
            "expert_drives": int(v["expert_drives"]),
            "policy_drives_where_expert_brakes": int(v["drives_wrong"]),
            "policy_brakes_where_expert_drives": int(v["brakes_wrong"]),
            "mean_abs_diff": round(v["abs_diff"] / n, 3), "policy_std": round(v["std"] / n, 3),
            "policy_std_where_they_disagree": round(v["std_wrong"] / max(v["drives_wrong"] + v["brakes_wrong"], 1), 3),
            "u_shaped_share": round(v["u_shaped"] / n, 3)}


def drive(env, policy, kind: int, args) -> collections.Counter:  # noqa: ANN001 - SimEnv, LoadedPolicy, Namespace
    """Drive the env's rows with the policy's mean action; sums over the live steps of scenario type ``kind``."""
    expert = envs.make_expert("sim", env)
    obs = env.reset(seed=args.seed)
    out: collections.Counter = collections.Counter()
    for _ in range(args.steps or env.max_episode_steps):
        c = env.state.scn
        rows = ((c.status == LIVE) & (env.scenarios.tab.type[c.scn] == kind)).any(1).nonzero().flatten()
        with torch.no_grad():
            action, alpha, beta = policy.distribution(obs)
        if len(rows):
            teacher = expert(obs)[rows, 1]
            mine, a, b = action[rows, 1], alpha[rows, 1], beta[rows, 1]
            std = 2.0 * (a * b / ((a + b) ** 2 * (a + b + 1))).sqrt()  # the action is 2x - 1 of the Beta variable
            brakes, drives = teacher < -args.margin, teacher > args.margin
            drives_wrong, brakes_wrong = brakes & (mine > args.margin), drives & (mine < -args.margin)
            out.update({"states": len(rows), "expert_brakes": int(brakes.sum()), "expert_drives": int(drives.sum()),
                        "drives_wrong": int(drives_wrong.sum()), "brakes_wrong": int(brakes_wrong.sum()),
                        "abs_diff": float((mine - teacher).abs().sum()), "std": float(std.sum()),
                        "std_wrong": float((std * (drives_wrong | brakes_wrong)).sum()),
                        "u_shaped": int(((a < 1) & (b < 1)).sum())})
        obs = env.step(action).obs
    return out


if __name__ == "__main__":
    main()
