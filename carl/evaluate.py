"""``carl-eval`` / ``python -m carl.evaluate``: benchmark a policy and write Leaderboard-style results.

Usage::

    carl-eval policy=expert benchmark=towns
    carl-eval policy=runs/quick-20250101-120000/best.pt benchmark=longest6 baselines=true
    carl-eval policy=bundles/quick benchmark=longest6 benchmark.towns=[Town01,Town02] out_dir=runs/eval/mine
    carl-eval policy=random benchmark=towns benchmark.num_routes=4 overwrite=true
    carl-eval --cfg policy=expert                     # print the composed config and exit

``policy`` is ``expert`` (the backend's rule-based expert, privileged state), ``random`` (uniform actions), a
training checkpoint (``.pt``) or a bundle directory (``carl-export``); learned policies act deterministically (the
Beta mean). Benchmarks (``conf/benchmark/*.yaml``) list route groups; each group is one batched env whose rows
drive all its routes in parallel (longest6: one group per town).

Output folder (``out_dir``, default ``runs/eval/<benchmark>-<policy>``)::

    results.json         Leaderboard 2.0 layout: _checkpoint.records (one per route, written as each finishes)
    summary.json         aggregates (DS, RC, IS, infractions per km, routes = the routes run)
    summary.md / .csv    the policy beside the random policy and the expert (baselines=true)
    score_per_route.png, infractions.png
    videos/<route>.gif   BEV of the worst routes (re-driven)
    baselines/<name>/    the baselines' own result folders

Re-running the same command resumes: finished routes are kept, a group whose routes all finished is skipped. A
folder holding results of another policy or benchmark is refused unless ``overwrite=true``.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from carl.checkpoint import CheckpointError
from carl.config import ConfigError
from carl.evaluate_loop import PolicyFn, aggregate, expert_factory, random_policy, run_first_episodes, write_result
from envs.api import BatchedEnv

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
REPO_DIR = CONF_DIR.parent
BASELINES = ("random", "expert")

# Leaderboard 2.0 record keys (benchmarks.md §2) for the simulator's infraction counters. off_road has no
# Leaderboard key (CARLA has no such test); it is reported under its own name.
LB_INFRACTION_KEYS: dict[str, str] = {
    "collision_pedestrian": "collisions_pedestrian",
    "collision_vehicle": "collisions_vehicle",
    "collision_static": "collisions_layout",
    "red_light": "red_light",
    "stop_sign": "stop_infraction",
    "outside_lanes": "outside_route_lanes",
    "route_deviation": "route_dev",
    "blocked": "vehicle_blocked",
    "timeout": "route_timeout",
    "off_road": "off_road",
    "min_speed": "min_speed_infractions",
}
LB_EMPTY_KEYS = ("yield_emergency_vehicle_infractions", "scenario_timeouts")
FAILED_STATUS = {
    "route_deviation": "Failed - Agent deviated from the route",
    "blocked": "Failed - Agent got blocked",
    "timeout": "Failed - Agent timed out",
    "max_steps": "Failed - Still running at max_steps (carl-eval's step limit)",
}


class EvalError(RuntimeError):
    """A benchmark or output folder that cannot be used as asked; the message says why and how to fix it."""


# ------------------------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------------------------
def compose(config_name: str, overrides: list[str]) -> dict[str, Any]:
    """Compose ``conf/<config_name>.yaml`` + overrides with Hydra's compose API (no cwd change); a plain dict."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
        data = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # noqa: BLE001 - Hydra/OmegaConf raise many types; all are user errors here
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = f"; `carl-{config_name} --cfg` prints every key" if "override" in msg.lower() else ""
        raise ConfigError(f"{msg} (overrides: {' '.join(overrides) or 'none'}){hint}") from None
    assert isinstance(data, dict)
    return data


def _repo_path(path: str) -> str:
    """A relative data path as given if it exists from the cwd, else relative to the repository root."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return str(p)
    return str(REPO_DIR / p)


# ------------------------------------------------------------------------------------------------------------------
# Benchmarks: route groups
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class RouteGroup:
    """Routes driven together by one batched env: row i drives route ``first_route + i`` of the env's routes."""

    name: str
    env: str
    options: dict[str, Any]
    num_routes: int

    @property
    def first_route(self) -> int:
        return int(self.options.get("first_route", 0))


@dataclass
class Benchmark:
    name: str
    env: str
    groups: list[RouteGroup]
    max_steps: int | None  # None: each env's own bound (SimEnv.max_episode_steps), else max_time / dt + 10
    config: dict[str, Any] = field(default_factory=dict)
    note: str = ""  # logged by carl-eval before the run (e.g. Val14: tokens found / missing)

    @property
    def num_routes(self) -> int:
        return sum(g.num_routes for g in self.groups)


def resolve_benchmark(bcfg: dict[str, Any]) -> Benchmark:
    """Turn ``conf/benchmark/<name>.yaml`` into route groups; a clear error for empty or unavailable benchmarks."""
    name, env = bcfg.get("name", "?"), bcfg.get("env", "sim")
    options = dict(bcfg.get("options") or {})
    if name == "val14" or env == "nuplan":
        return resolve_val14(bcfg)
    if env not in ("sim", "carla"):
        raise EvalError(f"benchmark={name}: env={env!r} is not supported by carl-eval (use sim, carla or nuplan)")
    groups: list[RouteGroup] = []
    route_file = bcfg.get("route_file")
    if env == "carla" and not route_file:
        raise EvalError(f"benchmark={name}: env=carla needs a route_file (Leaderboard route XML)")
    per_env = int(bcfg.get("parallel_routes") or 0)  # routes driven at once (CARLA: one server each); 0 = all
    if per_env < 0:
        raise EvalError(f"benchmark.parallel_routes={per_env} must be >= 1 (or null: every route of a town at once)")
    if route_file:
        from envs.routes import parse_leaderboard_xml

        path = _repo_path(route_file)
        routes = parse_leaderboard_xml(path)
        towns = sorted({town for _, town, _ in routes})
        wanted = bcfg.get("towns") or towns
        unknown = sorted(set(wanted) - set(towns))
        if unknown:
            raise EvalError(f"benchmark={name}: towns {unknown} have no routes in {path}; it has {towns}")
        limit = bcfg.get("routes_per_town")
        town_key = "town" if env == "carla" else "map"
        for town in wanted:
            n = sum(1 for _, t, _ in routes if t == town)
            n = min(n, int(limit)) if limit else n
            step = per_env or n
            for first in range(0, n, step):
                count = min(step, n - first)
                label = town if count == n else f"{town}[{first}:{first + count}]"
                groups.append(RouteGroup(label, env, {**options, town_key: town, "route_file": path,
                                                      "first_route": first}, count))
    else:
        n = int(bcfg.get("num_routes", 0))
        if n > 0:
            groups.append(RouteGroup(name, env, {**options, "num_routes": n}, n))
    if not groups or sum(g.num_routes for g in groups) == 0:
        raise EvalError(f"benchmark={name} has no routes (route_file={route_file!r}, towns={bcfg.get('towns')}, "
                        f"num_routes={bcfg.get('num_routes')}); give a route file with routes or num_routes >= 1")
    max_steps = int(bcfg["max_steps"]) if bcfg.get("max_steps") else None
    return Benchmark(name, env, groups, max_steps, dict(bcfg))


VAL14_GROUP_SIZE = 64  # scenarios simulated together by one nuPlan env (one row each)


def resolve_val14(bcfg: dict[str, Any]) -> Benchmark:
    """Val14 on ``env=nuplan``: the split yaml's tokens filtered to what the dataset (``options.data_root``, whose
    missing cache files are built first) or the cache (``options.cache_dir``) holds, in groups of ``group_size``
    scenarios. ``reactive`` selects IDM agents (the benchmark is then named ``<name>-reactive``)."""
    from envs.nuplan.cache import CacheError, build_cache, list_cache
    from envs.nuplan.reader import NuplanDataError, find_logs, list_scenarios, load_split_yaml

    name, env = str(bcfg.get("name", "val14")), str(bcfg.get("env", "nuplan"))
    if env != "nuplan":
        raise EvalError(f"benchmark={name} runs on env=nuplan, not env={env}")
    opts = dict(bcfg.get("options") or {})
    reactive = bool(bcfg.get("reactive", False) or opts.pop("reactive", False))
    split_yaml = opts.pop("split_yaml", None)
    cache_dir = _repo_path(str(opts.get("cache_dir") or "data/nuplan_cache"))
    data_root = opts.pop("data_root", None)
    tokens = opts.pop("tokens", None)
    try:
        if tokens is None:
            if not split_yaml:
                raise EvalError(f"benchmark={name}: set options.split_yaml (the Val14 token list) or options.tokens")
            tokens = load_split_yaml(_repo_path(str(split_yaml)))["scenario_tokens"] or []
        tokens = [str(t).lower() for t in tokens]
        source = f"cache {cache_dir}"
        if data_root:
            data_root = _repo_path(str(data_root))
            specs = [sp for log in find_logs(data_root, opts.get("split"), opts.get("log_names"))
                     for sp in list_scenarios(log, None, tokens)]
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            build_cache(specs, opts.get("maps_root") or Path(data_root) / "maps", cache_dir, int(opts.get("workers", 1)))
            source = f"dataset {data_root} (cache {cache_dir})"
        have = {f.stem for f in list_cache(cache_dir)} if Path(cache_dir).is_dir() else set()
    except (NuplanDataError, CacheError) as exc:
        raise EvalError(f"benchmark={name}: {exc}") from None
    found = [t for t in dict.fromkeys(tokens) if t in have]
    missing = len(set(tokens)) - len(found)
    note = (f"{name}: {len(found)} of {len(set(tokens))} scenario tokens found in the {source}; {missing} missing"
            + (" (not evaluated)" if missing else ""))
    if not found:
        raise EvalError(f"benchmark={name}: none of the {len(set(tokens))} scenario tokens "
                        f"({split_yaml or 'options.tokens'}) is in the {source}; point options.data_root at the "
                        "nuPlan val logs (or options.cache_dir at a cache built with --split-yaml)")
    size = int(bcfg.get("group_size") or VAL14_GROUP_SIZE)
    base = {k: v for k, v in opts.items() if k not in ("split", "log_names", "maps_root", "workers", "scenario_types")}
    base.update(cache_dir=cache_dir, data_root=None, route_split="eval", reactive=reactive)
    groups = [RouteGroup(f"{name}_{i // size:03d}", "nuplan",
                         {**base, "tokens": found[i:i + size], "max_scenarios": len(found[i:i + size])},
                         len(found[i:i + size])) for i in range(0, len(found), size)]
    max_steps = int(bcfg.get("max_steps") or 400)  # scenarios are 15 s (150 steps); episodes end by themselves
    config = {**bcfg, "reactive": reactive, "tokens_sha": hashlib.sha256(" ".join(found).encode()).hexdigest()[:16]}
    for k in ("options",):  # the data location does not define the benchmark
        config[k] = {kk: vv for kk, vv in (bcfg.get(k) or {}).items() if kk not in ("data_root", "cache_dir", "workers")}
    return Benchmark(f"{name}-reactive" if reactive else name, "nuplan", groups, max_steps, config, note)


def nuplan_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Val14 aggregates from the records' ``nuplan`` fields: closed-loop score (mean scenario score × 100), the
    per-metric means, per-type scores."""
    from envs.metrics.nuplan import ScenarioScore, aggregate as nuplan_aggregate

    scores = [ScenarioScore(r["route_id"], r["nuplan"]["scenario_type"], r["nuplan"]["multipliers"],
                            r["nuplan"]["weighted"]) for r in records if "nuplan" in r]
    agg = nuplan_aggregate(scores)
    return {"closed_loop_score": 100.0 * agg["score"] if scores else None,
            "nuplan_metrics": {k[len("metric/"):]: v for k, v in agg.items() if k.startswith("metric/")},
            "nuplan_types": {k[len("type/"):]: 100.0 * v for k, v in agg.items() if k.startswith("type/")}}


def nuplan_record_fields(ep: dict[str, float], scenario_type: str) -> dict[str, Any]:
    from envs.metrics.nuplan import MULTIPLIERS, WEIGHTS

    return {"score": ep.get("episode/nuplan_score"), "scenario_type": scenario_type,
            "multipliers": {k: ep.get(f"episode/nuplan/{k}") for k in MULTIPLIERS},
            "weighted": {k: ep.get(f"episode/nuplan/{k}") for k in WEIGHTS}}


# ------------------------------------------------------------------------------------------------------------------
# Policies
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class PolicySource:
    """What ``policy=`` named: a baseline or a learned policy (with its spec)."""

    name: str  # display name: expert, random, or the checkpoint/bundle name
    kind: str  # expert | random | learned
    identity: dict[str, Any]  # kind + weights hash; another identity in the same results folder is refused
    path: str | None = None  # resolved checkpoint/bundle path (informative: a moved bundle is the same policy)
    loaded: Any = None  # carl.bundle.LoadedPolicy
    spec: dict[str, Any] | None = None

    def env_options(self) -> dict[str, Any]:
        """Env options this policy needs: the BEV geometry it was trained on (baselines need no BEV)."""
        if self.spec is None:
            return {"bev": False}
        g = self.spec["bev_geometry"]
        return {"bev": True, "bev_size": g["bev_size"], "bev_ppm": g["bev_ppm"],
                "bev_ego_from_bottom": g["bev_ego_from_bottom"]}

    def make(self, env: BatchedEnv, backend: str) -> PolicyFn:
        """The callable for ``env`` (the expert reads the env's privileged state)."""
        if self.kind == "random":
            return random_policy(env)
        if self.kind == "expert":
            factory = expert_factory(backend)
            if factory is None:
                raise EvalError(f"env={backend} has no rule-based expert (envs.{backend}.expert)")
            return factory(env)
        self._check_obs(env)
        return self.loaded

    def _check_obs(self, env: BatchedEnv) -> None:
        assert self.spec is not None
        for key, want in self.spec["observations"].items():
            have = env.observation_spec.get(key)
            if have is None or list(have.shape) != list(want["shape"]):
                raise EvalError(f"policy {self.path} expects {key} of shape {want['shape']}, the "
                                f"benchmark env gives {None if have is None else list(have.shape)}")


def resolve_policy(arg: str, device: torch.device) -> PolicySource:
    """``expert`` | ``random`` | checkpoint file | bundle directory -> :class:`PolicySource`."""
    from carl.bundle import load_policy, sha256_file

    if arg in BASELINES:
        return PolicySource(arg, arg, {"kind": arg})
    path = Path(arg)
    if not path.exists():
        raise EvalError(f"policy={arg}: no such file or folder; use expert, random, a checkpoint .pt or a bundle dir")
    loaded, spec = load_policy(path, device=device, deterministic=True)
    weights = path / spec["files"]["weights"] if path.is_dir() else path
    name = path.name if path.is_dir() else f"{path.parent.name}/{path.stem}"
    identity = {"kind": "bundle" if path.is_dir() else "checkpoint", "sha256": sha256_file(weights)}
    return PolicySource(name, "learned", identity, path=str(path.resolve()), loaded=loaded, spec=spec)


# ------------------------------------------------------------------------------------------------------------------
# Leaderboard records
# ------------------------------------------------------------------------------------------------------------------
def make_record(index: int, route_id: str, ep: dict[str, float], route_length: float | None, group: str,
                route_index: int, wall_s: float, dt: float = 0.1) -> dict[str, Any]:
    """One Leaderboard 2.0 route record from the simulator's ``episode/...`` statistics."""
    counts = {name: int(round(ep.get(f"episode/infractions/{name}", 0.0))) for name in LB_INFRACTION_KEYS}
    infractions: dict[str, list[str]] = {key: [] for key in (*LB_INFRACTION_KEYS.values(), *LB_EMPTY_KEYS)}
    for name, n in counts.items():
        infractions[LB_INFRACTION_KEYS[name]] += [f"{name.replace('_', ' ')} #{i + 1} (built-in simulator)"
                                                  for i in range(n)]
    if counts.get("outside_lanes") and "episode/outside_lanes_pct" in ep:  # the Leaderboard's one event, with its %
        infractions["outside_route_lanes"] = [
            f"Agent went outside its route lanes for about {ep['episode/outside_lanes_pct']:.3f}% of the route "
            f"({counts['outside_lanes']} times)"]
    reason = next((k.rsplit("/", 1)[1] for k, v in ep.items() if k.startswith("episode/termination/") and v), "unknown")
    rc = round(float(ep["episode/route_completion"]), 4)
    penalty = round(float(ep["episode/infraction_score"]), 6)
    if reason == "route_completed":
        status = "Perfect" if sum(counts.values()) == 0 else "Completed"
    else:
        status = FAILED_STATUS.get(reason, f"Failed - Agent ended the route: {reason.replace('_', ' ')}")
    return {
        "index": index,
        "route_id": route_id,
        "status": status,
        "num_infractions": sum(len(v) for v in infractions.values()),
        "infractions": infractions,
        "scores": {"score_route": rc, "score_penalty": penalty,
                   "score_composed": round(max(rc * penalty, 0.0), 6)},
        "meta": {"route_length": route_length, "duration_game": round(float(ep.get("episode/length", 0)) * dt, 2),
                 "duration_system": round(wall_s, 2), "termination": reason},
        "carl": {"group": group, "route_index": route_index, "episode": ep},
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, sd


def summarize(records: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """Aggregates as the Leaderboard computes them (means over routes; infractions per km driven)."""
    result = aggregate([r["carl"]["episode"] for r in records], total)
    result["routes"] = len(records)
    result["routes_total"] = total
    for key, score in (("driving_score", "score_composed"), ("route_completion", "score_route"),
                       ("infraction_score", "score_penalty")):
        mean, sd = _mean_std([r["scores"][score] for r in records])
        result[key], result[f"{key}_std"] = mean, sd
    km = sum((r["meta"]["route_length"] or 0.0) / 1000.0 * r["scores"]["score_route"] / 100.0 for r in records)
    result["km"] = km
    result["infractions_per_km_lb"] = {
        key: (sum(len(r["infractions"].get(key, [])) for r in records) / km if km > 0 else None)
        for key in (*LB_INFRACTION_KEYS.values(), *LB_EMPTY_KEYS)}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["carl"]["group"], []).append(r)
    result["groups"] = {g: {"routes": len(rs),
                            "driving_score": _mean_std([r["scores"]["score_composed"] for r in rs])[0],
                            "route_completion": _mean_std([r["scores"]["score_route"] for r in rs])[0],
                            "infraction_score": _mean_std([r["scores"]["score_penalty"] for r in rs])[0]}
                        for g, rs in sorted(groups.items())}
    return result


# ------------------------------------------------------------------------------------------------------------------
# The results folder (resumable, never overwritten silently)
# ------------------------------------------------------------------------------------------------------------------
class ResultStore:
    """``results.json`` of one policy on one benchmark; each finished route is written at once (atomically)."""

    OUTPUTS = ("results.json", "summary.json", "summary.md", "summary.csv", "score_per_route.png",
               "infractions.png", "videos", "baselines")

    def __init__(self, out_dir: Path, identity: dict[str, Any], total: int, overwrite: bool) -> None:
        self.out_dir = out_dir
        self.path = out_dir / "results.json"
        self.identity = identity
        self.total = total
        existing = self._load(overwrite)
        if not overwrite:
            if existing is not None and existing.get("carl") != identity:
                raise EvalError(
                    f"{out_dir} already holds results of another evaluation:\n  found    {json.dumps(existing.get('carl'))}"
                    f"\n  this run {json.dumps(identity)}\npick another out_dir=, or pass overwrite=true to replace them")
            if existing is None and (out_dir / "summary.json").exists():
                raise EvalError(f"{out_dir} holds a summary.json without results.json; pick another out_dir= or pass "
                                "overwrite=true")
        else:
            self._clear()
            existing = None
        self.records: list[dict[str, Any]] = existing["_checkpoint"]["records"] if existing else []
        self.done = {r["route_id"] for r in self.records}

    def _load(self, overwrite: bool) -> dict[str, Any] | None:
        """The existing results.json (None if absent; unreadable is an error unless it will be overwritten)."""
        if not self.path.exists():
            return None
        try:
            data = json.loads(self.path.read_text())
            data["_checkpoint"]["records"]  # noqa: B018 - the layout check
            return data
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            if overwrite:
                return None
            raise EvalError(f"{self.path} is not a carl-eval results file ({type(exc).__name__}: {exc}); "
                            "pass overwrite=true to start over") from None

    def _clear(self) -> None:
        for name in self.OUTPUTS:
            p = self.out_dir / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()

    def add(self, record: dict[str, Any]) -> None:
        record["index"] = len(self.records)
        self.records.append(record)
        self.done.add(record["route_id"])
        self.write()

    def write(self, summary: dict[str, Any] | None = None) -> None:
        scores = [r["scores"] for r in self.records]
        finished = len(self.records) >= self.total
        payload = {
            "_checkpoint": {
                "global_record": {} if summary is None else {
                    "index": -1, "route_id": -1, "status": "Finished" if finished else "Started",
                    "scores_mean": {"score_composed": summary["driving_score"], "score_route": summary["route_completion"],
                                    "score_penalty": summary["infraction_score"]},
                    "scores_std_dev": {"score_composed": summary["driving_score_std"],
                                       "score_route": summary["route_completion_std"],
                                       "score_penalty": summary["infraction_score_std"]},
                    "infractions": summary["infractions_per_km_lb"],
                    "meta": {"total_length": summary["km"] * 1000.0, "exceptions": []},
                },
                "progress": [len(self.records), self.total],
                "records": self.records,
            },
            "entry_status": "Finished" if finished else "Started",
            "eligible": finished,
            "sensors": [],
            "values": [] if not scores else [f"{sum(s['score_composed'] for s in scores) / len(scores):.3f}",
                                             f"{sum(s['score_route'] for s in scores) / len(scores):.3f}",
                                             f"{sum(s['score_penalty'] for s in scores) / len(scores):.3f}"],
            "labels": ["Avg. driving score", "Avg. route completion", "Avg. infraction penalty"],
            "carl": self.identity,
        }
        write_result(payload, self.path)


# ------------------------------------------------------------------------------------------------------------------
# Driving
# ------------------------------------------------------------------------------------------------------------------
def _make_env(group: RouteGroup, num_envs: int, device: torch.device, seed: int, extra: dict[str, Any]) -> BatchedEnv:
    import envs

    if group.env == "nuplan":  # policy env options (BEV geometry) are SimConfig overrides there
        extra = {"sim": {**(group.options.get("sim") or {}), **extra}}
    try:
        return envs.make_env(group.env, num_envs=num_envs, device=device, seed=seed, **{**group.options, **extra})
    except (TypeError, ValueError) as exc:
        raise EvalError(f"benchmark group {group.name}: env {group.env!r} rejected its options: {exc}") from None


def run_group(group: RouteGroup, policy: PolicySource, store: ResultStore, device: torch.device, seed: int,
              max_steps: int, log: Callable[[str], None]) -> int:
    """Drive every route of ``group`` once (all rows in parallel); record the routes ``store`` lacks. Returns the
    number of routes recorded. Rows keep their route and traffic seed, so a resumed group reproduces the rows of an
    uninterrupted run; the loop stops as soon as the missing routes finished."""
    env = _make_env(group, group.num_routes, device, seed, policy.env_options())
    try:
        known = list(getattr(env, "route_names", []))  # every route of the env, by route id

        def name_of(rid: int) -> str:
            return known[rid] if rid < len(known) else f"{group.name}_{rid}"

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
            store.add(make_record(0, name_of(rid), ep, length, group.name, rid, time.perf_counter() - t0,
                                  float(group.options.get("dt", 0.1))))
            if "episode/nuplan_score" in ep:
                store.records[-1]["nuplan"] = nuplan_record_fields(ep, env.scenario_types[rid])
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
            max_steps = int(getattr(env, "max_episode_steps", 0)) or math.ceil(
                float(group.options.get("max_time", 1200.0)) / float(group.options.get("dt", 0.1))) + 10
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


# ------------------------------------------------------------------------------------------------------------------
# Reports: tables, plots, videos
# ------------------------------------------------------------------------------------------------------------------
TABLE_COLUMNS = ("policy", "routes", "driving_score", "route_completion", "infraction_score", "km")
# Reward-shaping counters of the simulator (speeding, ttc, comfort) are not Leaderboard infractions: they stay in
# summary.json but not in the tables and plots.
TABLE_INFRACTIONS = tuple(LB_INFRACTION_KEYS)


def table_rows(summaries: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: the main columns, then infractions per km of every type seen in any summary."""
    kinds = [k for k in TABLE_INFRACTIONS if any(k in s.get("infractions_per_km", {}) for s in summaries.values())]
    header = [*TABLE_COLUMNS, *(f"{k}/km" for k in kinds)]
    cls = any(s.get("closed_loop_score") is not None for s in summaries.values())  # Val14 (nuPlan)
    if cls:
        header.insert(2, "nuplan_cls")

    def fmt(v: Any, digits: int = 2) -> str:
        return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}f}"

    rows = []
    for name, s in summaries.items():
        rows.append([name, f"{s['routes']}/{s['routes_total']}", fmt(s["driving_score"]), fmt(s["route_completion"]),
                     fmt(s["infraction_score"], 3), fmt(s["km"])]
                    + [fmt(s.get("infractions_per_km", {}).get(k), 3) for k in kinds])
        if cls:
            rows[-1].insert(2, fmt(s.get("closed_loop_score")))
    return header, rows


def write_tables(summaries: dict[str, dict[str, Any]], out_dir: Path, title: str) -> None:
    header, rows = table_rows(summaries)
    md = [f"# {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    (out_dir / "summary.md").write_text("\n".join(md) + "\n")
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(header)
    writer.writerows(rows)
    (out_dir / "summary.csv").write_text(buf.getvalue())


def _font() -> Any:
    from PIL import ImageFont

    return ImageFont.load_default()


def plot_scores(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bar chart: route completion (light) and driving score (dark) per route, by group and route number."""
    from PIL import Image, ImageDraw

    def number(r: dict[str, Any]) -> int:  # route ids end in their number (Town01_3, ..._rand7919_12)
        tail = str(r["route_id"]).rsplit("_", 1)[-1]
        return int(tail) if tail.isdigit() else int(r["carl"]["route_index"])

    recs = sorted(records, key=lambda r: (r["carl"]["group"], number(r)))
    n = max(len(recs), 1)
    bar = max(6, min(24, 900 // n))
    left, top, bottom, right = 40, 30, 40, 20
    w, h = left + right + n * bar, 320
    img = Image.new("RGB", (max(w, 560), h), "white")
    d = ImageDraw.Draw(img)
    font = _font()
    ph = h - top - bottom
    for v in (0, 25, 50, 75, 100):
        y = top + ph - ph * v / 100
        d.line([(left, y), (left + n * bar, y)], fill=(220, 220, 220))
        d.text((4, y - 6), f"{v:3d}", fill="black", font=font)
    for i, r in enumerate(recs):
        x = left + i * bar
        for key, colour in (("score_route", (170, 200, 235)), ("score_composed", (30, 90, 170))):
            v = max(0.0, min(100.0, r["scores"][key]))
            d.rectangle([x + 1, top + ph - ph * v / 100, x + bar - 2, top + ph], fill=colour)
        if bar >= 12 or i % max(1, 12 // bar) == 0:
            d.text((x + 1, top + ph + 4), str(number(r)), fill="black", font=font)
    d.text((left, 8), f"{title}: driving score (dark) and route completion (light) per route", fill="black", font=font)
    d.text((left, h - 16), "route id (grouped by town)", fill=(90, 90, 90), font=font)
    img.save(path)


def plot_infractions(summary: dict[str, Any], path: Path, title: str) -> None:
    """Horizontal bars: infractions per km driven, by type."""
    from PIL import Image, ImageDraw

    items = [(k, v) for k, v in summary.get("infractions_per_km", {}).items() if k in TABLE_INFRACTIONS]
    font = _font()
    row, left, width = 20, 150, 360
    img = Image.new("RGB", (left + width + 80, 40 + row * max(len(items), 1)), "white")
    d = ImageDraw.Draw(img)
    d.text((8, 8), f"{title}: infractions per km ({summary['km']:.2f} km driven)", fill="black", font=font)
    top = max([v for _, v in items if v is not None] + [1e-9])
    for i, (name, v) in enumerate(items):
        y = 30 + i * row
        d.text((8, y + 3), name, fill="black", font=font)
        v = v or 0.0
        d.rectangle([left, y + 2, left + width * v / top, y + row - 4], fill=(200, 70, 60))
        d.text((left + width * v / top + 4, y + 3), f"{v:.3f}", fill="black", font=font)
    img.save(path)


def record_worst(records: list[dict[str, Any]], bench: Benchmark, policy: PolicySource, device: torch.device,
                 seed: int, count: int, max_frames: int, out_dir: Path, log: Callable[[str], None]) -> list[Path]:
    """Re-drive the ``count`` lowest-scoring routes with the BEV on and save annotated GIFs (sim backends only).

    The route is re-driven alone (one row), so traffic may differ from the evaluated episode."""
    if count <= 0 or bench.env != "sim":
        return []
    from PIL import Image

    from envs.sim.recorder import record_episode

    groups = {g.name: g for g in bench.groups}
    worst = sorted(records, key=lambda r: (r["scores"]["score_composed"], r["scores"]["score_route"]))[:count]
    paths = []
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    for r in worst:
        group = groups[r["carl"]["group"]]
        idx = int(r["carl"]["route_index"]) - group.first_route  # the row that drove it
        extra = {**policy.env_options(), "bev": True}
        env = _make_env(group, idx + 1, device, seed, extra)  # rows 0..idx; row idx drives that route
        try:
            frames, stats = record_episode(env, policy.make(env, group.env), row=idx, max_steps=max_frames,
                                           scale=max(1, 256 // env.cfg.bev_size))  # frames >= 256 px
        finally:
            env.close()
        if not frames:
            continue
        path = out_dir / "videos" / f"{r['route_id']}.gif"
        images = [Image.fromarray(f) for f in frames]
        images[0].save(path, save_all=True, append_images=images[1:], duration=100, loop=0, optimize=False)
        paths.append(path)
        end = (f"DS {stats['driving_score']:.1f} when re-driven" if "driving_score" in stats
               else f"cut at video_max_frames={max_frames}")
        log(f"  video {path} ({len(frames)} frames, {end})")
    return paths


# ------------------------------------------------------------------------------------------------------------------
# Orchestration
# ------------------------------------------------------------------------------------------------------------------
def evaluate_policy(policy: PolicySource, bench: Benchmark, out_dir: Path, device: torch.device, seed: int,
                    overwrite: bool, log: Callable[[str], None]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run (or resume) ``policy`` on ``bench`` into ``out_dir``; write results.json and summary.json."""
    # towns / routes_per_town / parallel_routes only select or batch routes: a run may be extended in the same folder
    defining = {k: v for k, v in bench.config.items() if k not in ("towns", "routes_per_town", "parallel_routes")}
    identity = {"policy": policy.identity, "benchmark": bench.name, "env": bench.env,
                "benchmark_config": hashlib.sha256(json.dumps(defining, sort_keys=True).encode()).hexdigest()[:16],
                "seed": seed}
    out_dir.mkdir(parents=True, exist_ok=True)
    store = ResultStore(out_dir, identity, bench.num_routes, overwrite)
    if store.records:
        log(f"{policy.name}: resuming {out_dir} ({len(store.records)}/{bench.num_routes} routes already finished)")
    for group in bench.groups:
        t0 = time.perf_counter()
        n = run_group(group, policy, store, device, seed, bench.max_steps, log)
        if n:
            log(f"{policy.name} | {group.name}: {n} routes in {time.perf_counter() - t0:.0f}s")
    summary = summarize(store.records, bench.num_routes)
    if bench.env == "nuplan":
        summary.update(nuplan_summary(store.records))
    summary.update(policy=policy.name, policy_id=policy.identity, policy_path=policy.path, benchmark=bench.name,
                   env=bench.env, seed=seed)
    store.write(summary)
    write_result(summary, out_dir / "summary.json")
    return summary, store.records


def default_out_dir(bench: str, policy: PolicySource) -> Path:
    safe = policy.name.replace("/", "-")
    return Path("runs") / "eval" / f"{bench}-{safe}"


def run(cfg: dict[str, Any], log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole ``carl-eval`` job for a composed config; returns the policy's summary."""
    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg["torch_threads"]))
    device = torch.device(cfg.get("device") or "cpu")
    bench = resolve_benchmark(cfg["benchmark"])
    policy = resolve_policy(str(cfg["policy"]), device)
    out_dir = Path(cfg["out_dir"]) if cfg.get("out_dir") else default_out_dir(bench.name, policy)
    seed, overwrite = int(cfg.get("seed", 0)), bool(cfg.get("overwrite", False))
    log(f"carl-eval: policy {policy.name} | benchmark {bench.name} ({bench.num_routes} routes in {len(bench.groups)} "
        f"groups, env {bench.env}) | out {out_dir}")
    if bench.note:
        log(bench.note)
    summary, records = evaluate_policy(policy, bench, out_dir, device, seed, overwrite, log)

    summaries = {policy.name: summary}
    if cfg.get("baselines"):
        for name in BASELINES:
            if name == policy.kind:
                continue
            base, _ = evaluate_policy(resolve_policy(name, device), bench, out_dir / "baselines" / name, device, seed,
                                      overwrite, log)
            summaries[name] = base
    title = f"{bench.name} ({bench.env}): {summary['routes']}/{bench.num_routes} routes"
    write_tables(summaries, out_dir, title)
    if records:
        plot_scores(records, out_dir / "score_per_route.png", f"{policy.name} on {bench.name}")
        plot_infractions(summary, out_dir / "infractions.png", f"{policy.name} on {bench.name}")
        record_worst(records, bench, policy, device, seed, int(cfg.get("worst_videos", 0)),
                     int(cfg.get("video_max_frames", 600)), out_dir, log)
    log((out_dir / "summary.md").read_text())
    log(f"results: {out_dir / 'results.json'}  summary: {out_dir / 'summary.json'}")
    return summary


# top-level shortcuts for benchmark keys: carl-eval benchmark=val14 env=nuplan reactive=true data_root=...
SHORTCUTS = {"env": "++benchmark.env", "reactive": "++benchmark.reactive",
             "data_root": "++benchmark.options.data_root", "cache_dir": "++benchmark.options.cache_dir"}



def expand_shortcuts(overrides: list[str]) -> list[str]:
    """``env=``, ``reactive=``, ``data_root=``, ``cache_dir=`` -> the benchmark keys they stand for."""
    out = []
    for a in overrides:
        key, eq, value = a.partition("=")
        out.append(f"{SHORTCUTS[key]}={value}" if eq and key in SHORTCUTS else a)
    return out


def main(argv: list[str] | None = None) -> None:
    from carl.bundle import BundleError
    from envs.maps.lanegraph import MapError
    from envs.routes import RouteError

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        sys.exit(0)
    overrides = expand_shortcuts([a for a in argv if a != "--cfg"])
    try:
        cfg = compose("eval", overrides)
        if "--cfg" in argv:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.create(cfg)))
            sys.exit(0)
        run(cfg)
    except (ConfigError, EvalError, CheckpointError, BundleError, RouteError, MapError) as exc:
        print(f"carl-eval error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted: finished routes are in results.json; re-run the same command to resume", file=sys.stderr)
        sys.exit(130)
    sys.exit(0)


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    main()
