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
    total = Counts()
    for name, env, policy in runs:
        if not hasattr(policy, "distribution"):
            sys.exit(f"--policy {args.policy}: a learned policy (checkpoint, bundle or zoo:<name>) is needed: the "
                     "probe reads its Beta distribution")
        counts = drive(env, policy, kind, args)
        total.add(counts)
        print(json.dumps({"routes": name, **counts.summary()}), flush=True)
    print(json.dumps({"policy": args.policy, "type": args.type, "all": True, **total.summary()}))


def _options(p) -> None:  # noqa: ANN001 - argparse.ArgumentParser
    p.add_argument("--type", default="SignalizedJunctionLeftTurn", help="the scenario type whose live steps count")
    p.add_argument("--margin", type=float, default=0.1, help="|longitudinal action| below this is neither")
    p.add_argument("--training", type=int, default=0, help="N rows of the training env instead of longest6")
    p.add_argument("--preset", default="towns_vector_clone", help="with --training: the preset whose env to build")
    p.add_argument("--steps", type=int, default=0, help="at most this many steps per env (0: the episode limit)")


class Counts:
    """Sums over the live steps of the probed type."""

    FIELDS = ("states", "expert_brakes", "expert_drives", "policy_drives_expert_brakes",
              "policy_brakes_expert_drives", "abs_diff_sum", "std_sum", "std_disagree_sum", "u_shaped")

    def __init__(self) -> None:
        self.v = dict.fromkeys(self.FIELDS, 0.0)

    def add(self, other: "Counts") -> None:
        for k in self.FIELDS:
            self.v[k] += other.v[k]

    def summary(self) -> dict:
        v, n = self.v, max(self.v["states"], 1)
        disagree = v["policy_drives_expert_brakes"] + v["policy_brakes_expert_drives"]
        return {"states": int(v["states"]), "expert_brakes": int(v["expert_brakes"]),
                "expert_drives": int(v["expert_drives"]),
                "policy_drives_where_expert_brakes": int(v["policy_drives_expert_brakes"]),
                "policy_brakes_where_expert_drives": int(v["policy_brakes_expert_drives"]),
                "mean_abs_diff": round(v["abs_diff_sum"] / n, 3), "policy_std": round(v["std_sum"] / n, 3),
                "policy_std_where_they_disagree": round(v["std_disagree_sum"] / max(disagree, 1), 3),
                "u_shaped_share": round(v["u_shaped"] / n, 3)}


def drive(env, policy, kind: int, args) -> Counts:  # noqa: ANN001 - SimEnv, LoadedPolicy, argparse.Namespace
    """Drive the env's rows with the policy's mean action; count the live steps of scenario type ``kind``."""
    sim = env
    while not hasattr(sim, "scenarios"):  # a wrapper around the simulator: its state and scenario tables
        sim = getattr(sim, "env", None) or getattr(sim, "inner")
    expert = envs.make_expert("sim", env)
    obs = env.reset(seed=args.seed)
    out = Counts()
    steps = args.steps or env.max_episode_steps
    for _ in range(steps):
        c = sim.state.scn
        live = ((c.status == LIVE) & (sim.scenarios.tab.type[c.scn] == kind)).any(1)
        with torch.no_grad():
            action, alpha, beta = policy.distribution(obs)
        rows = live.nonzero().flatten()
        if len(rows):
            teacher = expert(obs)[rows, 1]
            mine, a, b = action[rows, 1], alpha[rows, 1], beta[rows, 1]
            var = a * b / ((a + b) ** 2 * (a + b + 1))
            brakes, drives = teacher < -args.margin, teacher > args.margin
            wrong = (drives & (mine < -args.margin)) | (brakes & (mine > args.margin))
            std = 2.0 * var.sqrt()  # the action is 2x - 1 of the Beta variable
            for k, x in (("states", len(rows)), ("expert_brakes", brakes.sum()), ("expert_drives", drives.sum()),
                         ("policy_drives_expert_brakes", (brakes & (mine > args.margin)).sum()),
                         ("policy_brakes_expert_drives", (drives & (mine < -args.margin)).sum()),
                         ("abs_diff_sum", (mine - teacher).abs().sum()), ("std_sum", std.sum()),
                         ("std_disagree_sum", (std * wrong).sum()), ("u_shaped", ((a < 1) & (b < 1)).sum())):
                out.v[k] += float(x)
        res = env.step(action)
        obs = res.obs
    return out


if __name__ == "__main__":
    main()
