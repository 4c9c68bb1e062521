"""Benchmarks: a ``conf/benchmark/<name>.yaml`` config resolved into the route groups carl-eval drives.

A :class:`RouteGroup` is one batched env whose rows drive consecutive routes (longest6: one group per town, or per
``parallel_routes`` routes of a town; Val14: ``group_size`` nuPlan scenarios). Errors name the benchmark key and
say how to fix it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carl.eval import EvalError
from envs.data import DATA_PREFIX, DataError, data_path

REPO_DIR = Path(__file__).resolve().parents[2]
VAL14_GROUP_SIZE = 64  # scenarios simulated together by one nuPlan env (one row each)


def _repo_path(path: str) -> str:
    """``data:<dataset>/<file>``: that registry file (envs/data.py: the development copy, the cache, or fetched
    now); a relative data path as given if it exists from the cwd, else relative to the repository root."""
    if path.startswith(DATA_PREFIX):
        try:
            return data_path(path)
        except DataError as exc:
            raise EvalError(str(exc)) from None
    p = Path(path)
    if p.is_absolute() or p.exists():
        return str(p)
    return str(REPO_DIR / p)


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
    max_steps: int | None  # None: each env's own bound (max_episode_steps: every episode has ended by its rules)
    config: dict[str, Any] = field(default_factory=dict)
    note: str = ""  # logged by carl-eval before the run (e.g. Val14: tokens found / missing)
    repetitions: int = 1  # each route driven this many times, repetition k with traffic seed ``seed + k``

    @property
    def num_routes(self) -> int:
        return sum(g.num_routes for g in self.groups)

    @property
    def num_records(self) -> int:
        """Route records a finished run holds: every route once per repetition."""
        return self.num_routes * self.repetitions


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
        from envs.maps.routes import parse_leaderboard_xml

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
        if n > 0 and bcfg.get("towns"):  # random routes on each named map: one group (and summary row) per map
            for town in bcfg["towns"]:
                groups.append(RouteGroup(town, env, {**options, "map": town, "maps": [], "num_routes": n}, n))
        elif n > 0:
            groups.append(RouteGroup(name, env, {**options, "num_routes": n}, n))
    if not groups or sum(g.num_routes for g in groups) == 0:
        raise EvalError(f"benchmark={name} has no routes (route_file={route_file!r}, towns={bcfg.get('towns')}, "
                        f"num_routes={bcfg.get('num_routes')}); give a route file with routes or num_routes >= 1")
    max_steps = int(bcfg["max_steps"]) if bcfg.get("max_steps") else None
    return Benchmark(name, env, groups, max_steps, dict(bcfg), repetitions=_repetitions(bcfg))


def _repetitions(bcfg: dict[str, Any]) -> int:
    """``benchmark.repetitions`` (default 1), checked: a whole number >= 1."""
    value = bcfg.get("repetitions", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EvalError(f"benchmark.repetitions={value!r}: give a whole number >= 1 (each route is driven that many "
                        "times, repetition k with traffic seed seed + k)")
    return value


def resolve_val14(bcfg: dict[str, Any]) -> Benchmark:
    """Val14 on ``env=nuplan``: the split yaml's tokens filtered to what the dataset (``options.data_root``, whose
    missing cache files are built first) or the cache (``options.cache_dir``) holds, in groups of ``group_size``
    scenarios. ``reactive`` selects IDM agents (the benchmark is then named ``<name>-reactive``)."""
    from envs.nuplan.cache import CacheError, prepare_cache
    from envs.nuplan.reader import NuplanDataError, load_split_yaml

    name, env = str(bcfg.get("name", "val14")), str(bcfg.get("env", "nuplan"))
    if env != "nuplan":
        raise EvalError(f"benchmark={name} runs on env=nuplan, not env={env}")
    if _repetitions(bcfg) != 1:
        raise EvalError(f"benchmark.repetitions={bcfg['repetitions']}: {name} replays logged scenarios, which play the "
                        "same way every time; use repetitions=1")
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
            source = f"dataset {data_root} (cache {cache_dir})"
        have = prepare_cache(tokens, cache_dir, data_root, opts.get("split"), opts.get("log_names"),
                             opts.get("maps_root"), int(opts.get("workers", 1)))
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
