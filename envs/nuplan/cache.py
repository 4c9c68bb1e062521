"""Scenario cache: one compact, versioned ``.npz`` per scenario, built in parallel and resumable.

Path: ``<cache_dir>/<log_name>/<scenario_type>/<token>.npz`` (CaRL's layout). Content (local frame = global minus
``origin``, the ego's first rear-axle position):

* ``header``: JSON (cache version, token, log, type, map name/version, origin, dt, lane fids, light connectors,
  route roadblock ids, agent track tokens);
* ``g_*``: the map patch as :class:`~envs.maps.lanegraph.LaneGraph` arrays; ``route_points`` / ``route_lanes``:
  the expert route;
* ``ego`` [T, 7] rear axle x, y, heading, vx, vy, ax, ay; ``agents`` [T, N, 7] x, y, heading, length, width,
  vx, vy; ``agent_valid`` [T, N]; ``agent_types`` [N]; ``lights`` [T, G] status of each light group (0 green,
  1 yellow, 2 red, 3 unknown).

Agents are capped like CaRL (nearest to the ego over the scenario): 50 vehicles, 50 pedestrians, 10 bicycles,
10 static objects. A cache written by another :data:`CACHE_VERSION` is refused with an error naming the file.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, fields
from multiprocessing import get_context
from pathlib import Path
from typing import Iterable

import numpy as np

from envs.maps.lanegraph import LaneGraph
from envs.nuplan.mapgraph import build_patch
from envs.nuplan.nuplan_map import load_location
from envs.nuplan.reader import (AGENT_TYPES, ScenarioData, ScenarioSpec, find_logs, list_scenarios, load_scenario,
                                select_named)
from envs.routes import Route

CACHE_VERSION = 1
AGENT_CAPS = {"vehicle": 50, "pedestrian": 50, "bicycle": 10, "static": 10}
REAR_AXLE_TO_CENTRE = 1.461  # m, Chrysler Pacifica: (front length 4.049 - rear length 1.127) / 2


class CacheError(ValueError):
    """An unusable cache file; the message names it and says how to fix it."""


@dataclass
class CachedScenario:
    """One scenario as the environment consumes it (numpy, local frame)."""

    token: str
    log_name: str
    scenario_type: str
    map_name: str
    origin: np.ndarray  # [2] float64 global offset
    graph: LaneGraph
    route: Route
    ego: np.ndarray  # [T, 7]
    agents: np.ndarray  # [T, N, 7]
    agent_valid: np.ndarray  # [T, N]
    agent_types: np.ndarray  # [N]
    lights: np.ndarray  # [T, G] int8
    meta: dict = field(default_factory=dict)

    @property
    def num_frames(self) -> int:
        return self.ego.shape[0]


def cache_path(cache_dir: str | Path, spec: ScenarioSpec) -> Path:
    return Path(cache_dir) / spec.log_name / spec.scenario_type / f"{spec.token}.npz"


def cap_agents(data: ScenarioData) -> np.ndarray:
    """Indices of the agents kept: per class the nearest (over the scenario) to the ego, CaRL's caps."""
    d = np.linalg.norm(data.agents[..., :2] - data.ego[:, None, :2], axis=-1)
    d = np.where(data.agent_valid, d, np.inf).min(0) if data.agents.shape[1] else np.zeros(0)
    keep = []
    for cls, cap in AGENT_CAPS.items():
        names = ("vehicle",) if cls == "vehicle" else ("pedestrian",) if cls == "pedestrian" else \
            ("bicycle",) if cls == "bicycle" else AGENT_TYPES[3:]
        idx = np.nonzero(np.isin(data.agent_types, [AGENT_TYPES.index(n) for n in names]))[0]
        keep.extend(idx[np.argsort(d[idx], kind="stable")][:cap].tolist())
    return np.array(sorted(keep), np.int64)


def convert(data: ScenarioData, maps_root: str | Path, radius: float = 60.0) -> CachedScenario:
    """Scenario data + its map -> the cached form."""
    m = load_location(maps_root, data.spec.map_name)
    origin = data.ego[0, :2].copy()
    centre = data.ego[:, :2] + REAR_AXLE_TO_CENTRE * np.stack([np.cos(data.ego[:, 2]), np.sin(data.ego[:, 2])], -1)
    light_ids = {lc for frame in data.traffic_lights for lc, _ in frame}
    patch = build_patch(m, centre, origin, light_ids, data.route_roadblock_ids, radius=radius, name=data.spec.token)
    T = data.num_frames
    lights = np.full((T, max(1, len(patch.light_connectors))), 3, np.int8)
    col = {lc: k for k, lc in enumerate(patch.light_connectors)}
    for t, frame in enumerate(data.traffic_lights):
        for lc, status in frame:
            if lc in col:
                lights[t, col[lc]] = status
    keep = cap_agents(data)
    agents = data.agents[:, keep].copy()
    agents[..., :2] -= origin
    ego = data.ego.copy()
    ego[:, :2] -= origin
    return CachedScenario(token=data.spec.token, log_name=data.spec.log_name, scenario_type=data.spec.scenario_type,
                          map_name=m.name, origin=origin, graph=patch.graph, route=patch.route, ego=ego,
                          agents=agents, agent_valid=data.agent_valid[:, keep], agent_types=data.agent_types[keep],
                          lights=lights,
                          meta={"map_version": m.version, "lane_fids": patch.lane_fids,
                                "light_connectors": patch.light_connectors,
                                "route_roadblock_ids": data.route_roadblock_ids,
                                "agent_tokens": [data.agent_tokens[i] for i in keep],
                                "timestamps": data.timestamps.tolist()})


def save(sc: CachedScenario, path: str | Path) -> None:
    """Write atomically (``.tmp`` then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"version": CACHE_VERSION, "token": sc.token, "log_name": sc.log_name, "scenario_type": sc.scenario_type,
              "map_name": sc.map_name, "origin": sc.origin.tolist(), "graph_name": sc.graph.name,
              "graph_meta": sc.graph.meta, "route_name": sc.route.name, "meta": sc.meta}
    arrays = {f"g_{f.name}": getattr(sc.graph, f.name) for f in fields(sc.graph) if f.name not in ("name", "meta")}
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, header=np.frombuffer(json.dumps(header).encode(), np.uint8), route_points=sc.route.points,
                        route_lanes=sc.route.lanes, ego=sc.ego.astype(np.float64),
                        agents=sc.agents.astype(np.float32), agent_valid=sc.agent_valid,
                        agent_types=sc.agent_types.astype(np.int8), lights=sc.lights, **arrays)
    tmp.replace(path)


def read_header(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CacheError(f"cache file {path} does not exist")
    try:
        with np.load(path) as z:
            return json.loads(bytes(z["header"]).decode())
    except Exception as e:  # noqa: BLE001 - every unreadable file gets the same message
        raise CacheError(f"cache file {path} is unreadable ({e}); delete it and rebuild the cache") from e


def load(path: str | Path) -> CachedScenario:
    """Read one cache file; a file from another cache version is a :class:`CacheError` naming it."""
    path = Path(path)
    header = read_header(path)
    if header.get("version") != CACHE_VERSION:
        raise CacheError(f"cache file {path} has cache version {header.get('version')}, this carl reads version "
                         f"{CACHE_VERSION}; rebuild the cache (python -m envs.nuplan.cache ... --rebuild)")
    with np.load(path) as z:
        graph = LaneGraph(name=header["graph_name"], meta=header["graph_meta"],
                          **{k[2:]: z[k] for k in z.files if k.startswith("g_")})
        return CachedScenario(
            token=header["token"], log_name=header["log_name"], scenario_type=header["scenario_type"],
            map_name=header["map_name"], origin=np.array(header["origin"]), graph=graph,
            route=Route(header["route_name"], z["route_points"], z["route_lanes"]), ego=z["ego"],
            agents=z["agents"].astype(np.float64), agent_valid=z["agent_valid"],
            agent_types=z["agent_types"].astype(np.int64), lights=z["lights"], meta=header["meta"])


def _build_one(job: tuple[ScenarioSpec, str, str, float]) -> tuple[str, str | None]:
    spec, maps_root, out, radius = job
    try:
        save(convert(load_scenario(spec), maps_root, radius), out)
        return spec.token, None
    except Exception as e:  # noqa: BLE001 - a bad scenario is reported, the build goes on
        return spec.token, f"{type(e).__name__}: {e}"


@dataclass
class BuildReport:
    built: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already cached
    failed: dict[str, str] = field(default_factory=dict)  # token -> reason


def build_cache(specs: Iterable[ScenarioSpec], maps_root: str | Path, cache_dir: str | Path, workers: int = 1,
                rebuild: bool = False, radius: float = 60.0, progress: bool = True) -> BuildReport:
    """Cache every scenario of ``specs``; existing files of this version are skipped (resume), files of another
    version are rebuilt; failures are collected in the report without stopping the build."""
    report = BuildReport()
    jobs = []
    for spec in specs:
        out = cache_path(cache_dir, spec)
        if out.exists() and not rebuild:
            try:
                if read_header(out).get("version") == CACHE_VERSION:
                    report.skipped.append(spec.token)
                    continue
            except CacheError:
                pass
        jobs.append((spec, str(maps_root), str(out), radius))
    total, start = len(jobs), time.time()

    def tick(done: int) -> None:
        if progress:
            rate = done / max(time.time() - start, 1e-6)
            print(f"\r[nuplan cache] {done}/{total} built ({len(report.failed)} failed, {len(report.skipped)} already "
                  f"cached) {rate:.1f}/s", end="\n" if done == total else "", file=sys.stderr, flush=True)

    if workers > 1 and total > 1:
        with get_context("spawn").Pool(workers) as pool:
            results = pool.imap_unordered(_build_one, jobs)
            for k, (tok, err) in enumerate(results, 1):
                (report.failed.__setitem__(tok, err) if err else report.built.append(tok))
                tick(k)
    else:
        for k, job in enumerate(jobs, 1):
            tok, err = _build_one(job)
            (report.failed.__setitem__(tok, err) if err else report.built.append(tok))
            tick(k)
    for tok, err in report.failed.items():
        print(f"[nuplan cache] skipped bad scenario {tok}: {err}", file=sys.stderr)
    return report


def list_cache(cache_dir: str | Path, tokens: Iterable[str] | None = None, log_names: Iterable[str] | None = None,
               scenario_types: Iterable[str] | None = None) -> list[Path]:
    """Cache files under ``cache_dir`` (sorted), filtered by token, log or type; requested tokens must exist."""
    root = Path(cache_dir)
    if not root.is_dir():
        raise CacheError(f"scenario cache {root} does not exist; build it with python -m envs.nuplan.cache")
    files = sorted(root.glob("*/*/*.npz"))
    files = [f for f in files if not f.name.endswith(".tmp.npz")]
    if log_names is not None:
        logs = set(log_names)
        files = [f for f in files if f.parent.parent.name in logs]
    if scenario_types is not None:
        types = set(scenario_types)
        files = [f for f in files if f.parent.name in types]
    if tokens is not None:
        files = select_named([t.lower() for t in tokens], {f.stem: f for f in files}, CacheError,
                             f"scenario token(s) not in cache {root}")
    return files


def prepare_cache(tokens: Iterable[str], cache_dir: str | Path, data_root: str | Path | None = None,
                  split: str | None = None, log_names: Iterable[str] | None = None,
                  maps_root: str | Path | None = None, workers: int = 1) -> set[str]:
    """The scenario ``tokens`` (lower case) that ``cache_dir`` holds. With ``data_root``, the logs there (of
    ``split`` / ``log_names``) are scanned for the tokens and their missing cache files are built first (maps from
    ``maps_root``, default ``data_root/maps``); without it, the cache alone is used. Tokens found nowhere are left
    out; a missing data root or log raises :class:`~envs.nuplan.reader.NuplanDataError`."""
    wanted = list(tokens)
    if data_root:
        specs = [sp for log in find_logs(data_root, split, log_names) for sp in list_scenarios(log, None, wanted)]
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        build_cache(specs, maps_root or Path(data_root) / "maps", cache_dir, workers)
    have = {f.stem for f in list_cache(cache_dir)} if Path(cache_dir).is_dir() else set()
    return have.intersection(wanted)


def main(argv: list[str] | None = None) -> None:
    """``python -m envs.nuplan.cache DATA_ROOT CACHE_DIR [--split mini] [--tokens-yaml val14.yaml] [--workers 4]``"""
    import argparse

    from envs.nuplan.reader import load_split_yaml, select_scenarios

    ap = argparse.ArgumentParser(description="Build the nuPlan scenario cache")
    ap.add_argument("data_root")
    ap.add_argument("cache_dir")
    ap.add_argument("--maps-root", default=None, help="default: DATA_ROOT/maps")
    ap.add_argument("--split", default=None)
    ap.add_argument("--split-yaml", default=None, help="a scenario filter yaml such as val14_split.yaml")
    ap.add_argument("--types", nargs="*", default=None)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--rebuild", action="store_true")
    a = ap.parse_args(argv)
    flt: dict = {}
    if a.split_yaml:
        y = load_split_yaml(a.split_yaml)
        flt = {"tokens": y["scenario_tokens"], "scenario_types": y["scenario_types"]}
    if a.types:
        flt["scenario_types"] = a.types
    specs = select_scenarios(a.data_root, a.split, **flt)
    rep = build_cache(specs, a.maps_root or Path(a.data_root) / "maps", a.cache_dir, a.workers, a.rebuild)
    print(json.dumps({"built": len(rep.built), "skipped": len(rep.skipped), "failed": len(rep.failed)}))


if __name__ == "__main__":
    main()
