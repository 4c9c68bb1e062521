"""Scenario cache: one compact, versioned ``.npz`` per scenario, built in parallel and resumable.

Path: ``<cache_dir>/<log_name>/<scenario_type>/<token>.npz`` (CaRL's layout). Content (local frame = global minus
``origin``, the ego's first rear-axle position):

* ``header``: JSON (cache version, token, log, type, map name/version, origin, dt, lane fids, light connectors,
  route roadblock ids, agent track tokens, the map fid of every stored polygon);
* ``g_*``: the map patch as :class:`~envs.maps.lanegraph.LaneGraph` arrays; ``route_points`` / ``route_lanes``:
  the expert route;
* ``ego`` [T, 7] rear axle x, y, heading, vx, vy, ax, ay; ``agents`` [T, N, 7] x, y, heading, length, width,
  vx, vy; ``agent_valid`` [T, N]; ``agent_types`` [N]; ``lights`` [T, G] status of each light group (0 green,
  1 yellow, 2 red, 3 unknown);
* ``poly_<layer>_{xy,rings,parts}``: the map polygons the scoring and the reward need, clipped to ``radius`` around
  the logged ego path, as a :class:`PolygonSet` (float32 vertices + ring and polygon offsets, shapely's ragged
  layout): ``drivable`` (the devkit's DRIVABLE_AREA: road_segments + intersections + generic_drivable_areas +
  carpark_areas, what the drivable-area metric uses), ``carl_drivable`` (CaRL's off-road area: lane_groups_polygons
  + intersections + carpark_areas) and ``route_polygons`` (the route's roadblocks and roadblock connectors, for
  CaRL's off_route factor). ``CachedScenario.geometry(layer)`` gives one as a shapely geometry.

Agents are capped like CaRL (nearest to the ego over the scenario): 50 vehicles, 50 pedestrians, 10 bicycles,
10 static objects. A cache written by another :data:`CACHE_VERSION` is refused with an error naming the file (and
rebuilt by :func:`build_cache`, so an env or evaluation given ``data_root`` rebuilds it by itself).

Scale (the full Val14: 1,118 scenarios from ~2 TB of logs): the builder never holds more than one scenario per
worker process; jobs are ordered by map so a worker keeps one map in memory at a time; files are written to a temp
name and renamed (an interrupted build leaves no file that looks valid, and a rerun resumes where it stopped); bad
scenarios are skipped and listed in the :class:`BuildReport`. CLI: ``python -m envs.nuplan.cache --help``.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from envs.maps.lanegraph import LaneGraph
from envs.nuplan.gpkg import MissingPackageError
from envs.nuplan.mapgraph import POLYGON_FIELDS, PolygonSet, build_patch, map_layers, shapely_module
from envs.nuplan.nuplan_map import load_location, load_map
from envs.nuplan.reader import (AGENT_TYPES, NuplanDataError, ScenarioData, ScenarioSpec, find_logs, load_scenario,
                                missing_tokens_message, scan_logs, select_named)
from envs.maps.routes import Route

CACHE_VERSION = 2  # 2: map polygon layers (drivable, carl_drivable, route_polygons)
AGENT_CAPS = {"vehicle": 50, "pedestrian": 50, "bicycle": 10, "static": 10}
REAR_AXLE_TO_CENTRE = 1.461  # m, Chrysler Pacifica: (front length 4.049 - rear length 1.127) / 2
REBUILD_HINT = ("rebuild it: python -m envs.nuplan.cache --data-root <nuPlan root> --cache-dir <cache dir> (files "
                "of another version are rebuilt), or give env.options.data_root / data_root so it is rebuilt by itself")


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
    drivable: PolygonSet = field(default_factory=PolygonSet.empty)  # devkit DRIVABLE_AREA (the metric's)
    carl_drivable: PolygonSet = field(default_factory=PolygonSet.empty)  # CaRL's off-road area
    route_polygons: PolygonSet = field(default_factory=PolygonSet.empty)  # route roadblocks + connectors

    @property
    def num_frames(self) -> int:
        return self.ego.shape[0]

    def geometry(self, layer: str) -> Any:
        """One polygon layer (``drivable``, ``carl_drivable`` or ``route_polygons``) as a single shapely geometry
        (the union, local frame); ``getattr(sc, layer).polygons()`` gives the separate polygons."""
        if layer not in POLYGON_FIELDS:
            raise ValueError(f"unknown polygon layer {layer!r}; choose one of {', '.join(POLYGON_FIELDS)}")
        return getattr(self, layer).union()


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
    layers = map_layers(m, centre, origin, data.route_roadblock_ids, radius)
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
                          lights=lights, **layers,
                          meta={"map_version": m.version, "lane_fids": patch.lane_fids,
                                "light_connectors": patch.light_connectors,
                                "route_roadblock_ids": data.route_roadblock_ids,
                                "agent_tokens": [data.agent_tokens[i] for i in keep],
                                "timestamps": data.timestamps.tolist()})


def save(sc: CachedScenario, path: str | Path) -> None:
    """Write atomically: a temp file of this process, then a rename, so that an interrupted build never leaves a
    half-written file under the final name (and two builders never write into one temp file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"version": CACHE_VERSION, "token": sc.token, "log_name": sc.log_name, "scenario_type": sc.scenario_type,
              "map_name": sc.map_name, "origin": sc.origin.tolist(), "graph_name": sc.graph.name,
              "graph_meta": sc.graph.meta, "route_name": sc.route.name, "meta": sc.meta,
              "polygon_ids": {k: getattr(sc, k).ids for k in POLYGON_FIELDS}}
    arrays = {f"g_{f.name}": getattr(sc.graph, f.name) for f in fields(sc.graph) if f.name not in ("name", "meta")}
    for k in POLYGON_FIELDS:
        ps = getattr(sc, k)
        arrays.update({f"poly_{k}_xy": ps.xy.astype(np.float32), f"poly_{k}_rings": ps.rings.astype(np.int32),
                       f"poly_{k}_parts": ps.parts.astype(np.int32)})
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    try:
        np.savez_compressed(tmp, header=np.frombuffer(json.dumps(header).encode(), np.uint8),
                            route_points=sc.route.points, route_lanes=sc.route.lanes, ego=sc.ego.astype(np.float64),
                            agents=sc.agents.astype(np.float32), agent_valid=sc.agent_valid,
                            agent_types=sc.agent_types.astype(np.int8), lights=sc.lights, **arrays)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def read_header(path: str | Path) -> dict:
    """The JSON header of a cache file; a missing or unreadable file is a :class:`CacheError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise CacheError(f"cache file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            return json.loads(bytes(z["header"]).decode())
    except Exception as e:  # every unreadable file gets the same message
        raise CacheError(f"cache file {path} is unreadable ({e}); delete it and rebuild the cache") from e


def load(path: str | Path) -> CachedScenario:
    """Read one cache file; a file from another cache version is a :class:`CacheError` naming it."""
    path = Path(path)
    header = read_header(path)
    if header.get("version") != CACHE_VERSION:
        raise CacheError(f"cache file {path} has cache version {header.get('version')}, this carl reads version "
                         f"{CACHE_VERSION} (version 2 added the map polygon layers); {REBUILD_HINT}")
    try:
        with np.load(path, allow_pickle=False) as z:
            graph = LaneGraph(name=header["graph_name"], meta=header["graph_meta"],
                              **{k[2:]: z[k] for k in z.files if k.startswith("g_")})
            polys = {k: PolygonSet(z[f"poly_{k}_xy"], z[f"poly_{k}_rings"].astype(np.int64),
                                   z[f"poly_{k}_parts"].astype(np.int64), list(header["polygon_ids"][k]))
                     for k in POLYGON_FIELDS}
            return CachedScenario(
                token=header["token"], log_name=header["log_name"], scenario_type=header["scenario_type"],
                map_name=header["map_name"], origin=np.array(header["origin"]), graph=graph,
                route=Route(header["route_name"], z["route_points"], z["route_lanes"]), ego=z["ego"],
                agents=z["agents"].astype(np.float64), agent_valid=z["agent_valid"],
                agent_types=z["agent_types"].astype(np.int64), lights=z["lights"], meta=header["meta"], **polys)
    except (KeyError, ValueError, OSError) as e:
        raise CacheError(f"cache file {path} is incomplete or damaged ({type(e).__name__}: {e}); delete it and "
                         f"{REBUILD_HINT}") from e


_WORKER_MAP: list[str] = []  # the map this worker process holds (jobs come sorted by map)


def _build_one(job: tuple[ScenarioSpec, str, str, float]) -> tuple[str, str | None, bool]:
    """Build one cache file: (token, error or None, whether the error is a missing package)."""
    spec, maps_root, out, radius = job
    if _WORKER_MAP and _WORKER_MAP[0] != spec.map_name:
        load_map.cache_clear()  # keep one map per process: memory stays bounded by workers x one map
    _WORKER_MAP[:] = [spec.map_name]
    try:
        save(convert(load_scenario(spec), maps_root, radius), out)
        return spec.token, None, False
    except MissingPackageError as e:
        return spec.token, str(e), True
    except Exception as e:  # noqa: BLE001 - a bad scenario is reported, the build goes on
        return spec.token, f"{type(e).__name__}: {e}", False


@dataclass
class BuildReport:
    """What a build did: scenarios built, skipped (already cached) and failed (token -> reason, naming the log)."""

    built: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already cached
    failed: dict[str, str] = field(default_factory=dict)  # token -> reason
    seconds: float = 0.0

    def bad_scenarios(self) -> list[str]:
        """One line per failed scenario: token and reason (the reason names the log or map file)."""
        return [f"{tok}: {why}" for tok, why in self.failed.items()]


class _Progress:
    """tqdm when it is installed, else one status line (rewritten in place on a terminal, every 5 s otherwise)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done, self.start, self.last = total, enabled, 0, time.time(), 0.0
        self.bar = None
        if enabled and total:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="[nuplan cache]", unit="scenario", file=sys.stderr)
            except ImportError:
                pass

    def update(self, failed: int) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(failed=failed, refresh=False)
            return
        now = time.time()
        tty = sys.stderr.isatty()
        if self.done == self.total or tty or now - self.last >= 5.0:
            self.last = now
            rate = self.done / max(now - self.start, 1e-6)
            eta = (self.total - self.done) / max(rate, 1e-9)
            print(f"{chr(13) if tty else ''}[nuplan cache] {self.done}/{self.total} ({failed} failed) {rate:.2f}/s "
                  f"eta {eta:.0f} s", end="\n" if (self.done == self.total or not tty) else "", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def is_cached(path: str | Path) -> bool:
    """Whether ``path`` is a complete cache file of this version (resume skips it; anything else is rebuilt)."""
    try:
        return Path(path).is_file() and read_header(path).get("version") == CACHE_VERSION
    except CacheError:
        return False


def build_cache(specs: Iterable[ScenarioSpec], maps_root: str | Path, cache_dir: str | Path, workers: int = 1,
                rebuild: bool = False, radius: float = 60.0, progress: bool = True) -> BuildReport:
    """Cache every scenario of ``specs`` in ``workers`` processes. Complete files of this version are skipped
    (resume), files of another version or damaged ones are rebuilt; a bad scenario is skipped and listed in the
    report (and on stderr) without stopping the build; a missing package stops it (every scenario would fail)."""
    shapely_module()  # fail before any work when shapely is absent
    t0 = time.time()
    report = BuildReport()
    jobs = []
    for spec in specs:
        out = cache_path(cache_dir, spec)
        if not rebuild and is_cached(out):
            report.skipped.append(spec.token)
            continue
        jobs.append((spec, str(maps_root), str(out), radius))
    jobs.sort(key=lambda j: (j[0].map_name, j[0].log_name, j[0].anchor_ts))  # one map per worker at a time
    bar = _Progress(len(jobs), progress)
    where = {j[0].token: j[0] for j in jobs}

    def results() -> Iterator[tuple[str, str | None, bool]]:
        if workers > 1 and len(jobs) > 1:
            with get_context("spawn").Pool(min(workers, len(jobs))) as pool:
                yield from pool.imap_unordered(_build_one, jobs)
        else:
            yield from map(_build_one, jobs)

    try:
        for tok, err, missing_package in results():
            if missing_package:
                raise MissingPackageError(err)
            if err:
                sp = where[tok]
                report.failed[tok] = f"log {sp.log_name} ({sp.scenario_type}): {err}"
            else:
                report.built.append(tok)
            bar.update(len(report.failed))
    finally:
        bar.close()
    report.seconds = time.time() - t0
    for line in report.bad_scenarios():
        print(f"[nuplan cache] skipped bad scenario {line}", file=sys.stderr)
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
        wanted = [t.lower() for t in tokens]
        by_token = {f.stem: f for f in files}
        n_missing = len({t for t in wanted if t not in by_token})
        files = select_named(wanted, by_token, CacheError,
                             f"{n_missing} of {len(set(wanted))} requested scenario token(s) are not in the cache {root} "
                             f"(it holds {len(by_token)} matching scenario files; give data_root to build missing "
                             "ones from the logs)")
    return files


def prepare_cache(tokens: Iterable[str], cache_dir: str | Path, data_root: str | Path | None = None,
                  split: str | None = None, log_names: Iterable[str] | None = None,
                  maps_root: str | Path | None = None, workers: int = 1) -> set[str]:
    """The scenario ``tokens`` (lower case) that ``cache_dir`` holds. With ``data_root``, the logs there (of
    ``split`` / ``log_names``) are scanned for the tokens and their missing cache files are built first (maps from
    ``maps_root``, default ``data_root/maps``); without it, the cache alone is used. Tokens found nowhere are left
    out; when none of them ends up cached, the error says why (the tokens, the logs and split searched, the build
    failures); a missing data root or log raises :class:`~envs.nuplan.reader.NuplanDataError`."""
    wanted = list(dict.fromkeys(t.lower() for t in tokens))
    if data_root:
        logs = find_logs(data_root, split, log_names)
        specs = list(scan_logs(logs, None, wanted, workers=workers))
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        rep = build_cache(specs, maps_root or Path(data_root) / "maps", cache_dir, workers)
        have = {f.stem for f in list_cache(cache_dir)}.intersection(wanted)
        if wanted and not have:
            if not specs:
                raise NuplanDataError(f"none of the {len(wanted)} scenario tokens is in the dataset: "
                                      + missing_tokens_message(data_root, split, logs, wanted, len(wanted)))
            bad = "; ".join(rep.bad_scenarios()[:5])
            raise NuplanDataError(f"none of the {len(wanted)} scenario tokens could be cached: {len(specs)} found in "
                                  f"the logs under {data_root} and all failed to build: {bad}")
        return have
    have = {f.stem for f in list_cache(cache_dir)} if Path(cache_dir).is_dir() else set()
    return have.intersection(wanted)


def peak_memory_mb() -> dict[str, float]:
    """Peak resident memory (ru_maxrss) of this process and of its largest finished child process, in MB."""
    scale = 1.0 / 1024 if sys.platform != "darwin" else 1.0 / 2 ** 20  # KiB on Linux, bytes on macOS
    return {"self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, 1),
            "children": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale, 1)}


def main(argv: list[str] | None = None) -> int:
    """``python -m envs.nuplan.cache --data-root D --cache-dir C [--workers N] [--split-yaml Y] [--split S]``: build
    the cache and print one JSON line (scenarios built, seconds, scenarios/s, peak memory, bad scenarios)."""
    import argparse

    from envs.nuplan.reader import load_split_yaml, select_scenarios

    ap = argparse.ArgumentParser(prog="python -m envs.nuplan.cache", description="Build the nuPlan scenario cache")
    ap.add_argument("paths", nargs="*", metavar="DATA_ROOT CACHE_DIR", help="the old positional form")
    ap.add_argument("--data-root", default=None, help="nuPlan root (maps/, nuplan-v1.1/splits/...)")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--maps-root", default=None, help="default: DATA_ROOT/maps")
    ap.add_argument("--split", default=None, help="e.g. val (default: every log under DATA_ROOT)")
    ap.add_argument("--split-yaml", default=None, help="a scenario filter yaml such as val14_split.yaml")
    ap.add_argument("--types", nargs="*", default=None)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--radius", type=float, default=60.0, help="map patch radius around the ego path (m)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild files that are already cached")
    ap.add_argument("--allow-missing", action="store_true", help="build the tokens found; list the others")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a scenario failed")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    data_root = a.data_root or (a.paths[0] if a.paths else None)
    cache_dir = a.cache_dir or (a.paths[1] if len(a.paths) > 1 else None)
    if not data_root or not cache_dir:
        ap.error("give --data-root and --cache-dir")
    t0 = time.time()
    flt: dict[str, Any] = {}
    if a.split_yaml:
        y = load_split_yaml(a.split_yaml)
        flt = {"tokens": y["scenario_tokens"], "scenario_types": y["scenario_types"]}
    if a.types:
        flt["scenario_types"] = a.types
    try:
        specs = select_scenarios(data_root, a.split, workers=a.workers, allow_missing=a.allow_missing, **flt)
        missing = sorted({t.lower() for t in flt.get("tokens") or []} - {s.token for s in specs})
        scan_s = time.time() - t0
        rep = build_cache(specs, a.maps_root or Path(data_root) / "maps", cache_dir, a.workers, a.rebuild, a.radius,
                          progress=not a.no_progress)
    except (NuplanDataError, CacheError, MissingPackageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    secs = time.time() - t0
    for tok in missing:
        print(f"[nuplan cache] token not in the logs: {tok}", file=sys.stderr)
    print(json.dumps({"built": len(rep.built), "skipped": len(rep.skipped), "failed": len(rep.failed),
                      "missing_tokens": len(missing), "workers": a.workers, "seconds": round(secs, 2),
                      "scan_seconds": round(scan_s, 2),
                      "scenarios_per_s": round(len(rep.built) / max(rep.seconds, 1e-9), 3),
                      "peak_memory_mb": peak_memory_mb(), "bad_scenarios": rep.failed}), flush=True)
    return 1 if a.strict and rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
