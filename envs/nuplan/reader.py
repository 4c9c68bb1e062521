"""nuPlan SQLite logs without nuplan-devkit: log discovery, scenario extraction and loading.

Conventions follow ``../shared/docs/nuplan-data.md``: tokens are 8-byte BLOBs (hex strings here), timestamps integer
microseconds, positions global metric coordinates; ``ego_pose`` x/y is the rear axle; yaw comes from the quaternion.

A scenario is cut the way the devkit cuts it: the anchor is a tagged ``lidar_pc`` frame of the ``MergedPointCloud``
lidar in a *valid* scene (scenes ordered by name, first two and last two skipped), its type the maximum tag; the
window starts ``offset_s`` (-3 s) before the anchor, lasts ``duration_s`` (15 s) and keeps every second 20 Hz frame
(10 Hz), about 151 frames. The scenario token is the anchor's ``lidar_pc`` token.
"""
from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

PLANNING_LIDAR = "MergedPointCloud"
DURATION_S, OFFSET_S, SUBSAMPLE = 15.0, -3.0, 0.5
# traffic_light_status.status -> devkit TrafficLightStatusType
TL_STATUS = {"green": 0, "yellow": 1, "red": 2}
TL_UNKNOWN = 3
# category.name -> tracked-object type (devkit order)
AGENT_TYPES = ("vehicle", "pedestrian", "bicycle", "traffic_cone", "barrier", "czone_sign", "generic_object")
DYNAMIC_TYPES = ("vehicle", "pedestrian", "bicycle")


class NuplanDataError(ValueError):
    """Unreadable or inconsistent nuPlan data; the message names the file, log or token."""


@dataclass(frozen=True)
class ScenarioSpec:
    """Where a scenario lives: enough to load it (``load_scenario``) and to select it."""

    token: str  # anchor lidar_pc token, 16 hex characters
    log_name: str
    log_path: str
    scenario_type: str
    anchor_ts: int  # µs
    map_name: str  # log.map_version (a location such as us-nv-las-vegas-strip)


@dataclass
class ScenarioData:
    """One extracted scenario: 10 Hz frames, global coordinates (float64)."""

    spec: ScenarioSpec
    timestamps: np.ndarray  # [T] int64 µs (lidar_pc timestamps)
    ego: np.ndarray  # [T, 7] rear axle x, y, heading, vx, vy (body), ax, ay (body)
    agent_tokens: list[str]  # [N] track tokens
    agent_types: np.ndarray  # [N] int index into AGENT_TYPES
    agents: np.ndarray  # [T, N, 7] x, y, heading, length, width, vx, vy (centre, global)
    agent_valid: np.ndarray  # [T, N] bool
    traffic_lights: list[list[tuple[int, int]]]  # per frame (lane_connector_id, status 0..3)
    route_roadblock_ids: list[str]
    goal: np.ndarray | None  # [3] x, y, heading of the scene's goal ego pose
    frame_tokens: list[str] = field(default_factory=list)

    @property
    def num_frames(self) -> int:
        return len(self.timestamps)


def quaternion_yaw(qw: np.ndarray, qx: np.ndarray, qy: np.ndarray, qz: np.ndarray) -> np.ndarray:
    """Yaw of a quaternion (devkit: pyquaternion ``yaw_pitch_roll[0]``)."""
    return np.arctan2(2.0 * (qw * qz + qx * qy), 1.0 - 2.0 * (qy * qy + qz * qz))


# ---------------------------------------------------------------------------------------------- connections
def open_log(path: str | Path) -> sqlite3.Connection:
    """Open a log read-only and check that it is a nuPlan log; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise NuplanDataError(f"log file {path} does not exist")
    if path.stat().st_size < 512:
        raise NuplanDataError(f"log file {path} is truncated ({path.stat().st_size} bytes)")
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    query(con, path, "SELECT token FROM log LIMIT 1")
    return con


def query(con: sqlite3.Connection, path: str | Path, sql: str, args: Sequence = ()) -> list[sqlite3.Row]:
    """Run ``sql``; a corrupt or truncated database becomes a :class:`NuplanDataError` naming the file."""
    try:
        return con.execute(sql, args).fetchall()
    except sqlite3.DatabaseError as e:
        raise NuplanDataError(f"log file {path} is unreadable or truncated ({e}); re-download it") from e


def log_info(con: sqlite3.Connection, path: str | Path) -> tuple[str, str]:
    """(log name, map name) of an open log."""
    rows = query(con, path, "SELECT logfile, map_version FROM log")
    if len(rows) != 1:
        raise NuplanDataError(f"log file {path} has {len(rows)} rows in table 'log'; expected 1")
    return rows[0]["logfile"] or Path(path).stem, rows[0]["map_version"]


def find_logs(data_root: str | Path, split: str | None = None, log_names: Iterable[str] | None = None
              ) -> list[Path]:
    """Log files under ``data_root`` (recursively, or under ``nuplan-v1.1/splits/<split>``), optionally restricted
    to ``log_names`` (file stems); a requested log that is absent is an error naming it."""
    root = Path(data_root)
    if not root.is_dir():
        raise NuplanDataError(f"nuPlan data root {root} does not exist")
    base = root
    if split:
        for cand in (root / "nuplan-v1.1" / "splits" / split, root / "splits" / split, root / split):
            if cand.is_dir():
                base = cand
                break
        else:
            raise NuplanDataError(f"split '{split}' not found under {root} (looked for nuplan-v1.1/splits/{split})")
    logs = sorted(p for p in base.rglob("*.db") if p.is_file())
    if log_names is not None:
        logs = select_named(list(log_names), {p.stem: p for p in logs}, NuplanDataError, f"log(s) not found under {base}")
    return logs


def select_named(wanted: list[str], by_name: dict[str, Path], error: type[Exception], what: str) -> list[Path]:
    """``by_name[n]`` for every wanted name, in order; the missing ones (the first five, and how many more) in one
    ``error``."""
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise error(f"{what}: {', '.join(missing[:5])}" + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return [by_name[n] for n in wanted]


# ---------------------------------------------------------------------------------------------- scenario anchors
def list_scenarios(log_path: str | Path, scenario_types: Iterable[str] | None = None,
                   tokens: Iterable[str] | None = None, remove_invalid_goals: bool = True) -> list[ScenarioSpec]:
    """Every scenario anchor of one log (devkit ``get_scenarios_from_db`` semantics), sorted by time."""
    path = Path(log_path)
    con = open_log(path)
    try:
        log_name, map_name = log_info(con, path)
        scenes = query(con, path, "SELECT token, name, goal_ego_pose_token FROM scene ORDER BY name")
        valid = scenes[2:-2] if len(scenes) > 4 else []
        valid_tokens = {bytes(s["token"]) for s in valid
                        if not remove_invalid_goals or s["goal_ego_pose_token"] is not None}
        rows = query(con, path, """
            SELECT lp.token AS token, lp.timestamp AS ts, lp.scene_token AS scene, MAX(st.type) AS type
            FROM lidar_pc AS lp
            JOIN lidar AS l ON lp.lidar_token = l.token
            JOIN scenario_tag AS st ON st.lidar_pc_token = lp.token
            WHERE l.channel = ?
            GROUP BY lp.token
            ORDER BY lp.timestamp""", (PLANNING_LIDAR,))
    finally:
        con.close()
    types = set(scenario_types) if scenario_types is not None else None
    toks = {t.lower() for t in tokens} if tokens is not None else None
    out = []
    for r in rows:
        if bytes(r["scene"]) not in valid_tokens:
            continue
        tok = bytes(r["token"]).hex()
        if (types is not None and r["type"] not in types) or (toks is not None and tok not in toks):
            continue
        out.append(ScenarioSpec(token=tok, log_name=log_name, log_path=str(path), scenario_type=r["type"],
                                anchor_ts=int(r["ts"]), map_name=map_name))
    return out


def filter_scenarios(specs: list[ScenarioSpec], timestamp_threshold_s: float | None = None,
                     num_scenarios_per_type: int | None = None, limit_total: int | None = None
                     ) -> list[ScenarioSpec]:
    """The devkit's ScenarioFilter steps used by Val14 (no shuffle): per log and type, keep anchors at least
    ``timestamp_threshold_s`` apart (greedy in time order); then the first ``num_scenarios_per_type`` per type."""
    out = specs
    if timestamp_threshold_s:
        kept: list[ScenarioSpec] = []
        last: dict[tuple[str, str], int] = {}
        for s in sorted(specs, key=lambda s: (s.log_name, s.anchor_ts)):
            key = (s.log_name, s.scenario_type)
            if key in last and s.anchor_ts - last[key] < timestamp_threshold_s * 1e6:
                continue
            last[key] = s.anchor_ts
            kept.append(s)
        out = kept
    if num_scenarios_per_type is not None:
        count: dict[str, int] = {}
        kept = []
        for s in out:
            if count.get(s.scenario_type, 0) < num_scenarios_per_type:
                count[s.scenario_type] = count.get(s.scenario_type, 0) + 1
                kept.append(s)
        out = kept
    return out[:limit_total] if limit_total is not None else out


def load_split_yaml(path: str | Path) -> dict:
    """A devkit/tuplan_garage scenario-filter yaml (e.g. Val14): ``scenario_types``, ``scenario_tokens`` and the
    numeric filter settings. Interpolations such as ``${splitter...}`` are left as strings."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise NuplanDataError(f"scenario split file {path} does not exist")
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    return {"scenario_types": cfg.get("scenario_types"), "scenario_tokens": cfg.get("scenario_tokens"),
            "timestamp_threshold_s": cfg.get("timestamp_threshold_s"),
            "num_scenarios_per_type": cfg.get("num_scenarios_per_type"),
            "remove_invalid_goals": cfg.get("remove_invalid_goals", True)}


def select_scenarios(data_root: str | Path, split: str | None = None, log_names: Iterable[str] | None = None,
                     scenario_types: Iterable[str] | None = None, tokens: Iterable[str] | None = None,
                     timestamp_threshold_s: float | None = None, num_scenarios_per_type: int | None = None,
                     remove_invalid_goals: bool = True) -> list[ScenarioSpec]:
    """Scenarios of every log under ``data_root`` matching the filters. A requested token that no log holds is an
    error naming it (so a wrong token list fails loudly)."""
    specs: list[ScenarioSpec] = []
    for log in find_logs(data_root, split, log_names):
        specs.extend(list_scenarios(log, scenario_types, tokens, remove_invalid_goals))
    if tokens is not None:
        found = {s.token for s in specs}
        missing = [t for t in tokens if t.lower() not in found]
        if missing:
            raise NuplanDataError(f"scenario token(s) not found in the logs under {data_root}: "
                                  f"{', '.join(missing[:5])}" + (f" and {len(missing) - 5} more" if len(missing) > 5
                                                                 else ""))
    return filter_scenarios(specs, timestamp_threshold_s, num_scenarios_per_type)


# ---------------------------------------------------------------------------------------------- loading
def _in_clause(n: int) -> str:
    return "(" + ",".join("?" * n) + ")"


def scenario_frames(con: sqlite3.Connection, path: str | Path, anchor_ts: int, duration_s: float = DURATION_S,
                    offset_s: float = OFFSET_S, subsample: float = SUBSAMPLE) -> list[sqlite3.Row]:
    """The window's ``lidar_pc`` rows (token, timestamp, ego_pose_token, scene_token), every 1/subsample-th."""
    start = anchor_ts + int(round(offset_s * 1e6))
    end = start + int(round(duration_s * 1e6))
    rows = query(con, path, """
        SELECT lp.token AS token, lp.timestamp AS ts, lp.ego_pose_token AS ego, lp.scene_token AS scene
        FROM lidar_pc AS lp JOIN lidar AS l ON lp.lidar_token = l.token
        WHERE l.channel = ? AND lp.timestamp >= ? AND lp.timestamp <= ?
        ORDER BY lp.timestamp""", (PLANNING_LIDAR, start, end))
    step = max(1, int(round(1.0 / subsample)))
    return rows[::step]


def load_scenario(spec: ScenarioSpec, duration_s: float = DURATION_S, offset_s: float = OFFSET_S,
                  subsample: float = SUBSAMPLE) -> ScenarioData:
    """Ego, agents, traffic lights, route and goal of one scenario."""
    path = spec.log_path
    con = open_log(path)
    try:
        anchor = query(con, path, "SELECT scene_token FROM lidar_pc WHERE token = ?", (bytes.fromhex(spec.token),))
        if not anchor:
            raise NuplanDataError(f"scenario token {spec.token} not found in log file {path}")
        frames = scenario_frames(con, path, spec.anchor_ts, duration_s, offset_s, subsample)
        if len(frames) < 2:
            raise NuplanDataError(f"scenario {spec.token} in {path}: only {len(frames)} frames in its window")
        ftok = [bytes(f["token"]) for f in frames]
        frame_index = {t: i for i, t in enumerate(ftok)}
        T = len(frames)
        # ego (rear axle)
        etok = [bytes(f["ego"]) for f in frames]
        erows = query(con, path, f"SELECT * FROM ego_pose WHERE token IN {_in_clause(T)}", etok)
        by_tok = {bytes(r["token"]): r for r in erows}
        missing = [t.hex() for t in etok if t not in by_tok]
        if missing:
            raise NuplanDataError(f"scenario {spec.token} in {path}: ego_pose {missing[0]} missing")
        e = np.array([[by_tok[t][k] for k in ("x", "y", "qw", "qx", "qy", "qz", "vx", "vy", "acceleration_x",
                                              "acceleration_y")] for t in etok], np.float64)
        ego = np.stack([e[:, 0], e[:, 1], quaternion_yaw(e[:, 2], e[:, 3], e[:, 4], e[:, 5]), e[:, 6], e[:, 7],
                        e[:, 8], e[:, 9]], -1)
        # agents
        brows = query(con, path, f"""
            SELECT lb.lidar_pc_token AS frame, lb.track_token AS track, lb.x AS x, lb.y AS y, lb.yaw AS yaw,
                   lb.length AS length, lb.width AS width, lb.vx AS vx, lb.vy AS vy, c.name AS category
            FROM lidar_box AS lb JOIN track AS t ON lb.track_token = t.token
            JOIN category AS c ON t.category_token = c.token
            WHERE lb.lidar_pc_token IN {_in_clause(T)}""", ftok)
        tracks: dict[bytes, int] = {}
        types: list[int] = []
        for r in brows:
            tk = bytes(r["track"])
            if tk not in tracks:
                tracks[tk] = len(tracks)
                cat = r["category"]
                types.append(AGENT_TYPES.index(cat) if cat in AGENT_TYPES else AGENT_TYPES.index("generic_object"))
        N = len(tracks)
        agents = np.zeros((T, N, 7), np.float64)
        valid = np.zeros((T, N), bool)
        for r in brows:
            i, j = frame_index[bytes(r["frame"])], tracks[bytes(r["track"])]
            agents[i, j] = (r["x"], r["y"], r["yaw"], r["length"], r["width"], r["vx"] or 0.0, r["vy"] or 0.0)
            valid[i, j] = True
        # traffic lights
        lights: list[list[tuple[int, int]]] = [[] for _ in range(T)]
        for r in query(con, path, f"""SELECT lidar_pc_token AS frame, lane_connector_id AS lc, status
                                      FROM traffic_light_status WHERE lidar_pc_token IN {_in_clause(T)}""", ftok):
            lights[frame_index[bytes(r["frame"])]].append(
                (int(r["lc"]), TL_STATUS.get(str(r["status"]).lower(), TL_UNKNOWN)))
        # route and goal from the anchor's scene
        scene = query(con, path, "SELECT roadblock_ids, goal_ego_pose_token FROM scene WHERE token = ?",
                      (bytes(anchor[0]["scene_token"]),))
        route: list[str] = []
        goal = None
        if scene:
            ids = scene[0]["roadblock_ids"] or ""
            route = [x for x in ids.replace(",", " ").split() if x]
            if scene[0]["goal_ego_pose_token"] is not None:
                g = query(con, path, "SELECT x, y, qw, qx, qy, qz FROM ego_pose WHERE token = ?",
                          (bytes(scene[0]["goal_ego_pose_token"]),))
                if g:
                    goal = np.array([g[0]["x"], g[0]["y"], float(quaternion_yaw(*(np.float64(g[0][k])
                                                                                  for k in ("qw", "qx", "qy", "qz"))))])
    finally:
        con.close()
    return ScenarioData(spec=spec, timestamps=np.array([f["ts"] for f in frames], np.int64), ego=ego,
                        agent_tokens=[t.hex() for t in tracks], agent_types=np.array(types, np.int64),
                        agents=agents, agent_valid=valid, traffic_lights=lights, route_roadblock_ids=route, goal=goal,
                        frame_tokens=[t.hex() for t in ftok])


def wrap(a: np.ndarray | float) -> np.ndarray | float:
    """Angle wrapped to [-pi, pi)."""
    return (np.asarray(a) + math.pi) % (2 * math.pi) - math.pi
