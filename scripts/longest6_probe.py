"""What the longest6 probes share (``probe_right_turns.py``, ``probe_collisions.py``, ``probe_scenario_actions.py``):
their command line, and the benchmark's route groups as simulator envs with the policy to drive them (Leaderboard
rules, the route scenarios)."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from omegaconf import OmegaConf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from carl.eval.benchmarks import resolve_benchmark  # noqa: E402
from carl.eval.loop import make_group_env  # noqa: E402
from carl.eval.policies import resolve_policy  # noqa: E402


def parse_args(doc: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The probes' options (``doc``: the script's docstring, whose first paragraph is the help's description), and a
    probe's own (``extra`` adds them)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--policy", default="zoo:towns_vector", help="expert, a checkpoint, a bundle or zoo:<name>")
    p.add_argument("--towns", nargs="+", default=None, help="longest6 towns (default: all six)")
    p.add_argument("--seed", type=int, default=0, help="the evaluation's traffic seed")
    p.add_argument("--threads", type=int, default=2)
    if extra is not None:
        extra(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    return args


def policy_envs(args: argparse.Namespace) -> Iterator[tuple[Any, Callable]]:
    """(env, policy) for each of the benchmark's route groups in ``args.towns``, one row per route; each env is
    closed once the caller moves on."""
    return ((env, act) for _, env, act in policy_groups(args))


def policy_groups(args: argparse.Namespace) -> Iterator[tuple[str, Any, Callable]]:
    """:func:`policy_envs` with each group's name first."""
    bcfg = OmegaConf.to_container(OmegaConf.load(os.path.join(REPO, "conf/benchmark/longest6.yaml")))
    bcfg["towns"] = args.towns
    bench, dev = resolve_benchmark(bcfg), torch.device("cpu")
    policy = resolve_policy(args.policy, dev)
    for group in bench.groups:
        env = make_group_env(group, group.num_routes, dev, args.seed, policy.env_options())
        try:
            yield group.name, env, policy.make(env, "sim")
        finally:
            env.close()
