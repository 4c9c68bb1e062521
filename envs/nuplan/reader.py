"""nuPlan SQLite logs without nuplan-devkit: log discovery, scenario extraction and loading.

Conventions follow ``../shared/docs/nuplan-data.md``: tokens are 8-byte BLOBs (hex strings here), timestamps integer
microseconds, positions global metric coordinates; ``ego_pose`` x/y is the rear axle; yaw comes from the quaternion.

A scenario is cut the way the devkit cuts it: the anchor is a tagged ``lidar_pc`` frame of the ``MergedPointCloud``
lidar in a *valid* scene (scenes ordered by name, first two and last two skipped), its type the maximum tag; the
window starts ``offset_s`` (-3 s) before the anchor, lasts ``duration_s`` (15 s) and keeps every second 20 Hz frame
(10 Hz), about 151 frames. The scenario token is the anchor's ``lidar_pc`` token.

A window whose frames are not a clean 10 Hz series is refused with an error naming the log and token
(:func:`check_frames`): frames missing (a gap of more than :data:`MAX_GAP_FRAMES` frame intervals), frames out of
order (repeated ``lidar_pc`` timestamps, ego poses going back in time) or a window shorter than the 15 s horizon
(the log starts or ends inside it). The cache builder skips and lists such scenarios.
"""
from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from envs.data import data_path

PLANNING_LIDAR = "MergedPointCloud"
DURATION_S, OFFSET_S, SUBSAMPLE = 15.0, -3.0, 0.5
DB_INTERVAL_S = 0.05  # lidar_pc rate of the logs (20 Hz); a scenario frame is DB_INTERVAL_S / SUBSAMPLE apart
FRAME_S = DB_INTERVAL_S / SUBSAMPLE  # 0.1 s between scenario frames: the nuPlan env's step
# a gap between consecutive scenario frames above this many frame intervals means at least one frame is missing;
# 1.75 (not 1.5) so that one dropped 20 Hz lidar frame (a 1.5-interval step, which the devkit also produces) passes
MAX_GAP_FRAMES = 1.75
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
    base = split_dir(data_root, split)
    logs = sorted(p for p in base.rglob("*.db") if p.is_file())
    if log_names is not None:
        logs = select_named(list(log_names), {p.stem: p for p in logs}, NuplanDataError, f"log(s) not found under {base}")
    return logs


def split_dir(data_root: str | Path, split: str | None = None) -> Path:
    """The folder whose logs make up ``split`` (``data_root`` itself without a split)."""
    root = Path(data_root)
    if not root.is_dir():
        raise NuplanDataError(f"nuPlan data root {root} does not exist")
    if not split:
        return root
    for cand in (root / "nuplan-v1.1" / "splits" / split, root / "splits" / split, root / split):
        if cand.is_dir():
            return cand
    raise NuplanDataError(f"split '{split}' not found under {root} (looked for nuplan-v1.1/splits/{split})")


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
    from envs.nuplan.gpkg import require

    yaml = require("yaml", "reading a scenario split yaml", "pyyaml")
    path = Path(data_path(path))  # "data:val14/val14_split.yaml": a registry file, fetched on first use
    if not path.is_file():
        raise NuplanDataError(f"scenario split file {path} does not exist")
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    return {"scenario_types": cfg.get("scenario_types"), "scenario_tokens": cfg.get("scenario_tokens"),
            "timestamp_threshold_s": cfg.get("timestamp_threshold_s"),
            "num_scenarios_per_type": cfg.get("num_scenarios_per_type"),
            "remove_invalid_goals": cfg.get("remove_invalid_goals", True)}


def _scan_log(job: tuple) -> list[ScenarioSpec]:
    return list_scenarios(*job)


def scan_logs(logs: Sequence[Path], scenario_types: Iterable[str] | None = None, tokens: Iterable[str] | None = None,
              remove_invalid_goals: bool = True, workers: int = 1) -> Iterator[ScenarioSpec]:
    """The scenarios of every log, log by log (in ``workers`` processes: listing the ~1,400 val logs is I/O bound)."""
    types = list(scenario_types) if scenario_types is not None else None
    toks = list(tokens) if tokens is not None else None
    jobs = [(log, types, toks, remove_invalid_goals) for log in logs]
    if workers > 1 and len(jobs) >= 16:  # below that, starting the processes costs more than it saves
        from multiprocessing import get_context

        with get_context("spawn").Pool(min(workers, len(jobs))) as pool:
            for specs in pool.imap(_scan_log, jobs, chunksize=4):
                yield from specs
    else:
        for job in jobs:
            yield from _scan_log(job)


def _why_not_anchor(con: sqlite3.Connection, path: Path, raw: bytes, scenario_types: set[str] | None,
                    remove_invalid_goals: bool) -> str:
    """Why a ``lidar_pc`` frame of this log is no scenario anchor (one line)."""
    log = path.stem
    row = query(con, path, """SELECT l.channel AS channel, lp.scene_token AS scene FROM lidar_pc AS lp
                              JOIN lidar AS l ON lp.lidar_token = l.token WHERE lp.token = ?""", (raw,))
    if not row:
        return f"a lidar_pc row of log {log} without a lidar"
    if row[0]["channel"] != PLANNING_LIDAR:
        return f"a frame of log {log} from lidar channel {row[0]['channel']}, not {PLANNING_LIDAR}"
    tags = [r["type"] for r in query(con, path, "SELECT type FROM scenario_tag WHERE lidar_pc_token = ?", (raw,))]
    if not tags:
        return f"a frame of log {log} without a scenario tag (no scenario starts there)"
    scenes = [bytes(r["token"]) for r in query(con, path, "SELECT token FROM scene ORDER BY name")]
    scene = bytes(row[0]["scene"]) if row[0]["scene"] is not None else None
    valid = scenes[2:-2] if len(scenes) > 4 else []
    if scene not in valid:
        return f"a frame of log {log} in one of its first or last two scenes, which never hold scenarios"
    goal = query(con, path, "SELECT goal_ego_pose_token FROM scene WHERE token = ?", (scene,))
    if remove_invalid_goals and (not goal or goal[0]["goal_ego_pose_token"] is None):
        return f"a frame of log {log} whose scene has no goal pose (remove_invalid_goals drops it)"
    if scenario_types is not None and max(tags) not in scenario_types:
        return f"a {max(tags)} scenario of log {log}, a type not among the requested scenario types"
    return f"a scenario of log {log}, left out by the other filters"


def explain_missing(logs: Sequence[Path], missing: Sequence[str], scenario_types: Iterable[str] | None = None,
                    remove_invalid_goals: bool = True, limit: int = 5) -> dict[str, str]:
    """For the first ``limit`` tokens of ``missing``: why none of ``logs`` yields it as a scenario (the token is in no
    log, or it is a frame of a log but not an anchor: not tagged, in an edge scene, no goal, another type)."""
    todo = [t.lower() for t in missing[:limit]]
    why: dict[str, str] = {}
    types = set(scenario_types) if scenario_types is not None else None
    for log in logs:
        left = [t for t in todo if t not in why]
        if not left:
            break
        try:
            con = open_log(log)
        except NuplanDataError:
            continue
        try:
            raws = [bytes.fromhex(t) for t in left if len(t) == 16 and all(c in "0123456789abcdef" for c in t)]
            if not raws:
                continue
            for r in query(con, log, f"SELECT token FROM lidar_pc WHERE token IN {_in_clause(len(raws))}", raws):
                raw = bytes(r["token"])
                why[raw.hex()] = _why_not_anchor(con, log, raw, types, remove_invalid_goals)
        finally:
            con.close()
    return {t: why.get(t, "in none of these logs") for t in todo}


def missing_tokens_message(data_root: str | Path, split: str | None, logs: Sequence[Path], missing: Sequence[str],
                           requested: int, scenario_types: Iterable[str] | None = None,
                           remove_invalid_goals: bool = True) -> str:
    """Which tokens were not found, where they were looked for, and why each (of the first five) is missing."""
    base = split_dir(data_root, split)
    names = [p.stem for p in logs]
    where = (f"the {len(logs)} log(s) under {base} (split {split!r})" if split else
             f"the {len(logs)} log(s) under {base} (all splits)")
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    why = explain_missing(logs, list(missing), scenario_types, remove_invalid_goals)
    detail = "; ".join(f"{t}: {w}" for t, w in why.items())
    more = f"; and {len(missing) - len(why)} more" if len(missing) > len(why) else ""
    hints = []
    for w in why.values():
        h = ("point data_root / split at the logs these tokens come from (Val14's tokens are in the nuPlan val split)"
             if w == "in none of these logs" else
             "widen scenario_types (or drop the filter)" if "requested scenario types" in w else
             "remove them from the token list: under the devkit's rules these frames start no scenario")
        if h not in hints:
            hints.append(h)
    hint = "; ".join(hints)
    return (f"{len(missing)} of {requested} requested scenario token(s) are not scenarios of {where}"
            + (f" [{shown}]" if names else " (no .db files there)") + f": {detail}{more}. Fix: {hint}")


def select_scenarios(data_root: str | Path, split: str | None = None, log_names: Iterable[str] | None = None,
                     scenario_types: Iterable[str] | None = None, tokens: Iterable[str] | None = None,
                     timestamp_threshold_s: float | None = None, num_scenarios_per_type: int | None = None,
                     remove_invalid_goals: bool = True, workers: int = 1, allow_missing: bool = False
                     ) -> list[ScenarioSpec]:
    """Scenarios of every log under ``data_root`` matching the filters. A requested token that no log holds is an
    error naming it, the logs searched and why it is not there (so a wrong token list fails loudly), unless
    ``allow_missing`` (then the found ones are returned)."""
    tokens = list(tokens) if tokens is not None else None
    logs = find_logs(data_root, split, log_names)
    specs = list(scan_logs(logs, scenario_types, tokens, remove_invalid_goals, workers))
    if tokens is not None and not allow_missing:
        found = {s.token for s in specs}
        missing = [t for t in dict.fromkeys(tokens) if t.lower() not in found]
        if missing:
            raise NuplanDataError(missing_tokens_message(data_root, split, logs, missing, len(set(tokens)),
                                                         scenario_types, remove_invalid_goals))
    return filter_scenarios(specs, timestamp_threshold_s, num_scenarios_per_type)


# ---------------------------------------------------------------------------------------------- loading
def _in_clause(n: int) -> str:
    return "(" + ",".join("?" * n) + ")"


def window_rows(con: sqlite3.Connection, path: str | Path, anchor_ts: int, duration_s: float = DURATION_S,
                offset_s: float = OFFSET_S) -> list[sqlite3.Row]:
    """Every ``lidar_pc`` row (token, timestamp, ego_pose_token, scene_token) of the window, in time order."""
    start = anchor_ts + int(round(offset_s * 1e6))
    end = start + int(round(duration_s * 1e6))
    return query(con, path, """
        SELECT lp.token AS token, lp.timestamp AS ts, lp.ego_pose_token AS ego, lp.scene_token AS scene
        FROM lidar_pc AS lp JOIN lidar AS l ON lp.lidar_token = l.token
        WHERE l.channel = ? AND lp.timestamp >= ? AND lp.timestamp <= ?
        ORDER BY lp.timestamp""", (PLANNING_LIDAR, start, end))


def check_frames(frame_ts: np.ndarray, ego_ts: np.ndarray, start: int, end: int, dt: float, where: str,
                 raw_ts: np.ndarray | None = None) -> None:
    """Refuse a window that is not a clean series of frames ``dt`` seconds apart covering [start, end] (µs):
    repeated frame timestamps (in the kept frames or the raw 20 Hz ``raw_ts``) or ego poses going back in time (out
    of order), a gap of more than :data:`MAX_GAP_FRAMES` intervals (frames missing), or a window the log does not
    cover (shorter than the horizon). ``where`` names the scenario and log in the error."""
    fix = "re-download the log if it is damaged, or leave this scenario out (the cache builder skips it)"
    for ts in (frame_ts, raw_ts) if raw_ts is not None else (frame_ts,):
        rep = np.diff(ts) <= 0
        if rep.any():
            i = int(np.nonzero(rep)[0][0])
            raise NuplanDataError(f"{where}: frames out of order: lidar_pc timestamps {ts[i]} and {ts[i + 1]} "
                                  f"({(ts[i] - start) / 1e6:.2f} s into the window) repeat; {fix}")
    step = np.diff(frame_ts)
    back = np.diff(ego_ts)
    if (back < 0).any():
        i = int(np.nonzero(back < 0)[0][0])
        raise NuplanDataError(f"{where}: frames out of order: the ego pose of frame {i + 1} (ego_pose.timestamp "
                              f"{ego_ts[i + 1]}) is older than that of frame {i} ({ego_ts[i]}) while their lidar_pc "
                              f"timestamps increase; {fix}")
    limit = MAX_GAP_FRAMES * dt * 1e6
    if (step > limit).any():
        i = int(np.argmax(step))
        raise NuplanDataError(f"{where}: frames missing: a gap of {step[i] / 1e6:.3f} s between frames {i} and "
                              f"{i + 1} (t = {(frame_ts[i] - start) / 1e6:.2f} s into the window; the frame interval "
                              f"is {dt:.2f} s); {fix}")
    head, tail = (frame_ts[0] - start) / 1e6, (end - frame_ts[-1]) / 1e6
    if head > MAX_GAP_FRAMES * dt or tail > MAX_GAP_FRAMES * dt:
        side = "starts" if head > MAX_GAP_FRAMES * dt else "ends"
        raise NuplanDataError(f"{where}: shorter than the {(end - start) / 1e6:.1f} s horizon: the log {side} inside "
                              f"the window, which holds only {(frame_ts[-1] - frame_ts[0]) / 1e6:.1f} s "
                              f"({len(frame_ts)} frames); such a scenario cannot be simulated to its end, leave it "
                              "out (the cache builder skips it)")


def load_scenario(spec: ScenarioSpec, duration_s: float = DURATION_S, offset_s: float = OFFSET_S,
                  subsample: float = SUBSAMPLE) -> ScenarioData:
    """Ego, agents, traffic lights, route and goal of one scenario."""
    path = spec.log_path
    con = open_log(path)
    try:
        anchor = query(con, path, "SELECT scene_token FROM lidar_pc WHERE token = ?", (bytes.fromhex(spec.token),))
        if not anchor:
            raise NuplanDataError(f"scenario token {spec.token} not found in log file {path}")
        raw = window_rows(con, path, spec.anchor_ts, duration_s, offset_s)
        frames = raw[::max(1, int(round(1.0 / subsample)))]
        where = f"scenario {spec.token} of log file {path}"
        if len(frames) < 2:
            raise NuplanDataError(f"{where}: only {len(frames)} frames in its {duration_s:.0f} s window (shorter than "
                                  "the horizon); leave it out (the cache builder skips it)")
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
        start = spec.anchor_ts + int(round(offset_s * 1e6))
        check_frames(np.array([f["ts"] for f in frames], np.int64),
                     np.array([by_tok[t]["timestamp"] or 0 for t in etok], np.int64), start,
                     start + int(round(duration_s * 1e6)), DB_INTERVAL_S / subsample, where,
                     np.array([r["ts"] for r in raw], np.int64))
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
