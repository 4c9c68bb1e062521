"""Deterministic evaluation on held-out routes, used during and at the end of training.

An evaluation env of ``N`` rows is built with the eval options (``route_split="eval"``); every row runs until its
first episode ends and that episode is kept, so ``N`` rows give ``N`` episodes on the same routes each time.
Metrics are aggregated like the leaderboard: mean driving score, route completion and infraction score over
episodes; infractions per km (sum of counts / sum of km).

Any policy can be evaluated: a *policy factory* takes the eval env and returns a *policy callable*
``obs dict -> action tensor [B, 2]`` (the expert needs the env for privileged state; the others ignore it).
"""
from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any, Callable

import torch

from carl.logging import EpisodeStats
from envs.api import BatchedEnv

PolicyFn = Callable[[dict[str, torch.Tensor]], torch.Tensor]
PolicyFactory = Callable[[BatchedEnv], PolicyFn]
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


def aggregate(episodes: list[dict[str, float]], requested: int) -> dict[str, Any]:
    """Leaderboard-style means over episodes (+ per-km infractions, termination reasons)."""
    stats = EpisodeStats()
    for ep in episodes:
        stats.add_episode(ep)
    summary = stats.summary()
    result: dict[str, Any] = {
        "driving_score": summary.get("episode/driving_score", float("nan")),
        "route_completion": summary.get("episode/route_completion", float("nan")),
        "infraction_score": summary.get("episode/infraction_score", float("nan")),
        "return": summary.get("episode/return", float("nan")),
        "episodes": len(episodes),
        "unfinished": requested - len(episodes),
        "infractions_per_km": {},
        "termination": {},
    }
    for key, val in summary.items():
        if key.startswith("episode/infractions_per_km/"):
            result["infractions_per_km"][key.rsplit("/", 1)[1]] = val
        elif key.startswith("episode/termination/"):
            result["termination"][key.rsplit("/", 1)[1]] = val
        elif key.startswith("episode/") and key not in ("episode/count",) and "/infractions/" not in key:
            result.setdefault("means", {})[key[len("episode/"):]] = val
    return result


def evaluate(make_env: EnvFactory, factory: PolicyFactory, episodes: int, max_steps: int, seed: int) -> dict[str, Any]:
    """Evaluate one policy on ``episodes`` held-out routes."""
    env = make_env(episodes)
    try:
        eps = run_first_episodes(env, factory(env), max_steps, seed=seed)
    finally:
        env.close()
    return aggregate(eps, episodes)


def evaluate_many(
    make_env: EnvFactory, factories: dict[str, PolicyFactory], episodes: int, max_steps: int, seed: int
) -> dict[str, dict[str, Any]]:
    """Evaluate several policies on the same routes (same env options and seed)."""
    return {name: evaluate(make_env, f, episodes, max_steps, seed) for name, f in factories.items()}


def _json_safe(obj: Any) -> Any:
    """NaN/inf (e.g. the means of zero finished episodes) become null so the file is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_result(result: dict[str, Any], path: str | Path) -> Path:
    """Write ``result`` as JSON atomically (tmp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_json_safe(result), indent=2, sort_keys=True, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


# ------------------------------------------------------------------------------------------------------------------
# Baseline policies
# ------------------------------------------------------------------------------------------------------------------
def random_policy(env: BatchedEnv) -> PolicyFn:
    """Uniform actions in [-1, 1]^2 (the floor any learned policy should beat)."""
    gen = torch.Generator(device="cpu").manual_seed(12345)

    def act(obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return (torch.rand(env.num_envs, 2, generator=gen) * 2 - 1).to(env.device)

    return act


def expert_factory(backend: str) -> PolicyFactory | None:
    """The backend's rule-based expert, if it ships one (hook: ``envs.<backend>.expert.make_expert(env)`` or ``Expert(env)``).

    Returns None when the module or the function is absent, so callers just skip the expert column.
    """
    try:
        module = importlib.import_module(f"envs.{backend}.expert")
    except ImportError:
        return None
    for name in ("make_expert", "Expert", "expert_policy", "ExpertPolicy"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn  # type: ignore[return-value]
    return None
