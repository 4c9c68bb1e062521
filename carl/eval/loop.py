"""Driving policies over routes with batched envs.

An env of ``N`` rows runs until each wanted row finished its first episode, and that episode is kept, so ``N`` rows
give ``N`` episodes on the same routes each time (:func:`run_first_episodes`). The trainer's deterministic
evaluation on held-out routes (``route_split="eval"``) is :func:`evaluate`; carl-eval drives a benchmark's route
groups into a resumable results folder (:func:`run_group`, :func:`evaluate_policy`).
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from carl.eval import EvalError
from carl.factory import make_env
from carl.eval.benchmarks import Benchmark, RouteGroup
from carl.eval.policies import PolicyFactory, PolicyFn, PolicySource
from carl.eval.store import (ResultStore, aggregate, nuplan_record_fields, nuplan_summary, scenario_record_fields,
                             summarize, write_result)
from envs.api import BatchedEnv
from envs.config import ConfigError
from envs.metrics.leaderboard import make_record

EnvFactory = Callable[[int], BatchedEnv]  # num_envs -> eval env


def run_first_episodes(env: BatchedEnv, policy: PolicyFn, max_steps: int, seed: int | None = None,
                       on_episode: Callable[[int, dict[str, float]], None] | None = None,
                       rows: set[int] | None = None) -> list[dict[str, float]]:
    """Step all rows until each wanted row (default: all) finished one episode, or ``max_steps``; return those
    episodes' statistics in row order. ``on_episode(row, stats)`` is called as each one finishes."""
    obs = env.reset(seed=seed)
    wanted = set(range(env.num_envs)) if rows is None else set(rows)
    episodes: dict[int, dict[str, float]] = {}
    for _ in range(max_steps):
        if len(episodes) == len(wanted):
            break
        with torch.no_grad():
            action = policy(obs)
        res = env.step(action)
        done = (res.terminated | res.truncated).cpu()
        for row in done.nonzero(as_tuple=True)[0].tolist():
            if row in wanted and row not in episodes:
                episodes[row] = {k: float(v[row].reshape(-1)[0]) for k, v in res.info.items()
                                 if k.startswith("episode/")}
                if on_episode is not None:
                    on_episode(row, episodes[row])
        obs = res.obs
    return [episodes[r] for r in sorted(episodes)]


def evaluate(make_env: EnvFactory, factory: PolicyFactory, episodes: int, max_steps: int, seed: int) -> dict[str, Any]:
    """Evaluate one policy on ``episodes`` held-out routes."""
    env = make_env(episodes)
    try:
        eps = run_first_episodes(env, factory(env), max_steps, seed=seed)
    finally:
        env.close()
    return aggregate(eps, episodes)


def make_group_env(group: RouteGroup, num_envs: int, device: torch.device, seed: int,
                   extra: dict[str, Any]) -> BatchedEnv:
    """The env of ``group`` with ``num_envs`` rows (row i drives route ``first_route + i``), ``extra`` options (the
    policy's BEV geometry) on top (:func:`carl.factory.make_env`)."""
    try:
        return make_env(group.env, num_envs, device, seed, group.options, extra, where=f"benchmark group {group.name}")
    except ConfigError as exc:
        raise EvalError(str(exc)) from None


def run_group(group: RouteGroup, policy: PolicySource, store: ResultStore, device: torch.device, seed: int,
              max_steps: int | None, log: Callable[[str], None], repetition: int | None = None) -> int:
    """Drive every route of ``group`` once (all rows in parallel); record the routes ``store`` lacks. Returns the
    number of routes recorded. Rows keep their route and traffic seed, so a resumed group reproduces the rows of an
    uninterrupted run; the loop stops as soon as the missing routes finished. With a ``repetition`` number the
    records are ``<route>_rep<k>`` (the Leaderboard's naming) with ``carl.repetition`` k."""
    env = make_group_env(group, group.num_routes, device, seed, policy.env_options())
    try:
        known = list(getattr(env, "route_names", []))  # every route of the env, by route id

        def name_of(rid: int) -> str:
            name = known[rid] if rid < len(known) else f"{group.name}_{rid}"
            return name if repetition is None else f"{name}_rep{repetition}"

        first = group.first_route
        pending = {row for row in range(group.num_routes) if name_of(first + row) not in store.done}
        if not pending:
            return 0
        lengths = getattr(env, "route_lengths", None)
        act = policy.make(env, group.env)
        t0 = time.perf_counter()
        recorded = 0

        def record(row: int, ep: dict[str, float]) -> None:
            nonlocal recorded
            rid = int(ep.get("episode/route_id", first + row))
            length = float(lengths[rid]) if lengths is not None else None
            rec = make_record(0, name_of(rid), ep, length, group.name, rid, time.perf_counter() - t0, env.control_dt)
            rec["carl"]["repetition"] = repetition or 0
            store.add(rec)
            if "episode/nuplan_score" in ep:
                store.records[-1]["nuplan"] = nuplan_record_fields(ep, env.data.scenario_types[rid])
                store.write()
            world = getattr(env, "world", None)
            if world is not None and getattr(world, "route_scenarios", None) and world.route_scenarios[rid]:
                store.records[-1]["scenarios"] = scenario_record_fields(ep, world.route_scenarios[rid])
                store.write()
            pending.discard(row)
            recorded += 1
            rec = store.records[-1]
            if "nuplan" in rec:
                log(f"  {name_of(rid)}: nuPlan score {100 * rec['nuplan']['score']:6.2f}  ({rec['nuplan']['scenario_type']})")
                return
            log(f"  {name_of(rid)}: DS {rec['scores']['score_composed']:6.2f}  RC {rec['scores']['score_route']:6.2f}"
                f"  IS {rec['scores']['score_penalty']:.3f}  {rec['status']}")

        if not max_steps:
            max_steps = int(getattr(env, "max_episode_steps", 0))
        if not max_steps:
            raise ValueError(f"{group.name}: the env ({type(env).__name__}) states no max_episode_steps; give the "
                             "evaluation a step limit (benchmark.max_steps / logging.eval_max_steps)")
        run_first_episodes(env, act, max_steps, seed=seed, on_episode=record, rows=set(pending))
        if pending and hasattr(env, "running_episodes"):  # still driving: reported as they stand, never dropped
            running = env.running_episodes()
            for row in sorted(pending):
                ep = {k: float(v[row].reshape(-1)[0]) for k, v in running.items()}
                ep["episode/termination/max_steps"] = 1.0
                record(row, ep)
        elif pending:
            log(f"  {len(pending)} routes of {group.name} did not finish within max_steps={max_steps}; env "
                f"{group.env} cannot report running routes, so they are missing from the results")
        return recorded
    finally:
        env.close()


def evaluate_policy(policy: PolicySource, bench: Benchmark, out_dir: Path, device: torch.device, seed: int,
                    overwrite: bool, log: Callable[[str], None]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run (or resume) ``policy`` on ``bench`` into ``out_dir``; write results.json and summary.json."""
    # towns / routes_per_town / parallel_routes only select or batch routes: a run may be extended in the same folder
    defining = {k: v for k, v in bench.config.items() if k not in ("towns", "routes_per_town", "parallel_routes")
                and not (k == "repetitions" and v == 1)}  # (folders of one repetition from before the key existed)
    identity = {"policy": policy.identity, "benchmark": bench.name, "env": bench.env,
                "benchmark_config": hashlib.sha256(json.dumps(defining, sort_keys=True).encode()).hexdigest()[:16],
                "seed": seed}
    out_dir.mkdir(parents=True, exist_ok=True)
    store = ResultStore(out_dir, identity, bench.num_records, overwrite)
    if store.records:
        log(f"{policy.name}: resuming {out_dir} ({len(store.records)}/{bench.num_records} routes already finished)")
    reps = bench.repetitions
    for rep in range(reps):  # repetition k: every group again with traffic seed seed + k
        for group in bench.groups:
            t0 = time.perf_counter()
            n = run_group(group, policy, store, device, seed + rep, bench.max_steps, log, rep if reps > 1 else None)
            if n:
                label = f"{group.name}, repetition {rep + 1}/{reps}" if reps > 1 else group.name
                log(f"{policy.name} | {label}: {n} routes in {time.perf_counter() - t0:.0f}s")
    summary = summarize(store.records, bench.num_records)
    if bench.env == "nuplan":
        summary.update(nuplan_summary(store.records))
    summary.update(policy=policy.name, policy_id=policy.identity, policy_path=policy.path, benchmark=bench.name,
                   env=bench.env, seed=seed)
    store.write(summary)
    write_result(summary, out_dir / "summary.json")
    return summary, store.records
