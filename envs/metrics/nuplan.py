"""nuPlan's closed-loop score (CLS), per scenario and aggregated (``../shared/docs/benchmarks.md`` Part B).

Scenario score S = (M_collision · M_drivable · M_direction · M_progress) · (5·progress + 5·TTC + 4·speed +
2·comfort) / 16; the final score is the mean of S over scenarios (× 100 as CLS-NR / CLS-R). The same metric set
scores non-reactive and reactive runs; only the agents differ.

Every metric is a pure numpy function of the simulated trace; the geometry the metrics need from a map (lane of
the ego, corner distances to the drivable area, per-step progress along lane baselines and along the expert's
route, speed limits) is passed in as arrays, so the functions stay testable with hand-computed cases.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from envs.comfort import comfort_checks, comfort_signals, rear_axle_to_center_acceleration

# multipliers
DRIVABLE_MAX_VIOLATION = 0.3  # m
DIRECTION_WINDOW_S = 1.0
DIRECTION_COMPLIANT, DIRECTION_VIOLATION = 2.0, 6.0  # m of backwards progress
PROGRESS_MIN_RATIO = 0.2
PROGRESS_THRESHOLD = 2.0  # m
COLLISION_THRESHOLDS = {"vru": 0, "vehicle": 0, "object": 1}
STOPPED_SPEED = 0.05  # m/s
REAR_ANGLE = math.radians(150.0)
# weighted metrics
WEIGHTS = {"ego_progress": 5.0, "time_to_collision": 5.0, "speed_limit": 4.0, "comfort": 2.0}
TTC_THRESHOLD, TTC_HORIZON, TTC_STEP = 0.95, 3.0, 0.1
TTC_AHEAD_ANGLE = math.radians(30.0)
TTC_STOPPED_SPEED = 0.005
SPEED_VIOLATION_MAX = 2.23  # m/s
MULTIPLIERS = ("no_at_fault_collisions", "drivable_area_compliance", "driving_direction_compliance",
               "making_progress")


# ---------------------------------------------------------------------------------------------- geometry
def box_corners(xy: np.ndarray, yaw: np.ndarray, half: np.ndarray) -> np.ndarray:
    """Corners [..., 4, 2] (front-left, front-right, rear-right, rear-left) of oriented boxes."""
    c, s = np.cos(yaw)[..., None], np.sin(yaw)[..., None]
    f = np.concatenate([c, s], -1) * half[..., :1]
    l = np.concatenate([-s, c], -1) * half[..., 1:2]
    xy = np.asarray(xy)
    return np.stack([xy + f + l, xy + f - l, xy - f - l, xy - f + l], -2)


def boxes_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Separating-axis overlap of convex quads ``a`` [..., 4, 2] and ``b`` [..., 4, 2] (broadcast)."""
    a, b = np.broadcast_arrays(a, b)
    hit = np.ones(a.shape[:-2], bool)
    for q in (a, b):
        for k in range(2):
            e = q[..., k + 1, :] - q[..., k, :]
            n = np.stack([-e[..., 1], e[..., 0]], -1)[..., None, :]
            pa, pb = (a * n).sum(-1), (b * n).sum(-1)
            hit &= (pa.max(-1) >= pb.min(-1)) & (pb.max(-1) >= pa.min(-1))
    return hit


def segment_hits_box(p0: np.ndarray, p1: np.ndarray, box: np.ndarray) -> bool:
    """Whether the segment p0-p1 touches the convex quad ``box`` (SAT with the segment as a degenerate quad)."""
    return bool(boxes_overlap(np.stack([p0, p1, p1, p0]), np.asarray(box)))


# ---------------------------------------------------------------------------------------------- multipliers
def collision_type(ego_xy: np.ndarray, ego_yaw: float, ego_half: np.ndarray, ego_speed: float, obj_xy: np.ndarray,
                   obj_yaw: float, obj_half: np.ndarray, obj_speed: float, obj_static: bool,
                   rear_xy: np.ndarray | None = None) -> str:
    """nuPlan's classification of one collision: STOPPED_EGO, STOPPED_TRACK, ACTIVE_REAR, ACTIVE_FRONT or
    ACTIVE_LATERAL (in that order of precedence). "Behind" is judged from the rear axle ``rear_xy`` (the ego centre
    when not given), as the devkit does."""
    if ego_speed <= STOPPED_SPEED:
        return "STOPPED_EGO"
    if obj_static or obj_speed <= STOPPED_SPEED:
        return "STOPPED_TRACK"
    rel = np.asarray(obj_xy) - np.asarray(ego_xy if rear_xy is None else rear_xy)
    angle = abs((math.atan2(rel[1], rel[0]) - ego_yaw + math.pi) % (2 * math.pi) - math.pi)
    if angle > REAR_ANGLE:
        return "ACTIVE_REAR"
    ego = box_corners(np.asarray(ego_xy), np.asarray(ego_yaw), np.asarray(ego_half))
    obj = box_corners(np.asarray(obj_xy), np.asarray(obj_yaw), np.asarray(obj_half))
    if segment_hits_box(ego[0], ego[1], obj):
        return "ACTIVE_FRONT"
    return "ACTIVE_LATERAL"


def is_at_fault(kind: str, ego_in_multiple_lanes_or_off_road: bool) -> bool:
    """FRONT and STOPPED_TRACK are at fault; LATERAL only during a lane change or off the drivable area."""
    return kind in ("ACTIVE_FRONT", "STOPPED_TRACK") or (kind == "ACTIVE_LATERAL" and ego_in_multiple_lanes_or_off_road)


def collision_score(at_fault_counts: dict[str, int]) -> float:
    """Π over {vru, vehicle, object} of max(0, 1 − n / (threshold + 1)); 1 without at-fault collisions."""
    score = 1.0
    for cls, thr in COLLISION_THRESHOLDS.items():
        score *= max(0.0, 1.0 - at_fault_counts.get(cls, 0) / (thr + 1))
    return score


def drivable_area_compliance(corner_outside_m: np.ndarray) -> float:
    """``corner_outside_m`` [T, 4]: each ego corner's distance to the drivable area (0 inside). 0 if any corner is
    ever at least 0.3 m outside."""
    return 0.0 if np.any(np.asarray(corner_outside_m) >= DRIVABLE_MAX_VIOLATION) else 1.0


def driving_direction_compliance(lane_progress: np.ndarray, dt: float) -> float:
    """``lane_progress`` [T]: per-step progress along the current lane's baseline (negative = against it). Sums
    over the last 1 s; m = the worst (most negative) sum: 1 if −m < 2 m, 0.5 if < 6 m, else 0."""
    p = np.asarray(lane_progress, np.float64)
    if p.size == 0:
        return 1.0
    w = max(1, int(round(DIRECTION_WINDOW_S / dt)))
    c = np.concatenate([[0.0], np.cumsum(p)])
    sums = c[1:] - c[np.maximum(np.arange(1, len(c)) - w, 0)]
    worst = max(0.0, -float(sums.min()))
    return 1.0 if worst < DIRECTION_COMPLIANT else 0.5 if worst < DIRECTION_VIOLATION else 0.0


def path_progress(points: np.ndarray, path: np.ndarray) -> float:
    """Summed per-frame progress [m] of ``points`` [T, 2] along the polyline ``path`` [M, 2]: each point's arc length
    at its nearest point of the path, differenced frame to frame (backwards steps count negative)."""
    points, path = np.asarray(points, np.float64), np.asarray(path, np.float64)
    if len(points) < 2 or len(path) < 2:
        return 0.0
    a, d = path[:-1], np.diff(path, axis=0)  # [M-1, 2]
    seg_len = np.linalg.norm(d, axis=-1)
    cum = np.concatenate([[0.0], np.cumsum(seg_len)])
    rel = points[:, None, :] - a[None]  # [T, M-1, 2]
    u = np.clip((rel * d).sum(-1) / np.maximum(seg_len ** 2, 1e-12), 0.0, 1.0)
    dist = np.linalg.norm(rel - u[..., None] * d, axis=-1)
    k = dist.argmin(-1)
    arc = cum[k] + u[np.arange(len(points)), k] * seg_len[k]
    return float(np.diff(arc).sum())


def progress_ratio(ego_progress: float, expert_progress: float | None) -> float:
    """``ego_progress_along_expert_route``: min(1, max(P_ego, 2) / max(P_exp, 2)); 0 if P_ego < −2 m; 1 without
    an expert route."""
    if expert_progress is None:
        return 1.0
    if ego_progress < -PROGRESS_THRESHOLD:
        return 0.0
    return min(1.0, max(ego_progress, PROGRESS_THRESHOLD) / max(expert_progress, PROGRESS_THRESHOLD))


def making_progress(ratio: float) -> float:
    return 1.0 if ratio >= PROGRESS_MIN_RATIO else 0.0


# ---------------------------------------------------------------------------------------------- weighted
def speed_limit_compliance(speed: np.ndarray, limit: np.ndarray, dt: float) -> float:
    """1 − Σ(overspeed · dt) / (2.23 m/s · duration), floored at 0; duration = (T − 1) · dt (≥ dt)."""
    speed, limit = np.asarray(speed, np.float64), np.asarray(limit, np.float64)
    over = np.clip(speed - limit, 0.0, None)
    duration = max(len(speed) - 1, 1) * dt
    return max(0.0, 1.0 - float(over.sum() * dt) / (SPEED_VIOLATION_MAX * duration))


def ego_is_comfortable(accel: np.ndarray, yaw_rate: np.ndarray, yaw_acc: np.ndarray, heading: np.ndarray,
                       rear_to_centre: float, dt: float) -> float:
    """1 if the six comfort signals stay within their bounds over the whole run, else 0. Inputs per state: the rear
    axle's acceleration along the heading (nuPlan's bicycle model has no lateral one), yaw rate, yaw acceleration
    and heading; the signals are derived as the devkit does (:mod:`envs.comfort`)."""
    def row(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a, np.float64)).reshape(1, -1)

    n = torch.tensor([len(heading)])
    c = rear_axle_to_center_acceleration(row(accel), row(yaw_rate), row(yaw_acc), rear_to_centre)
    signals = comfort_signals(c.lon, c.lat, row(heading), n, dt, acc_magnitude=c.rear_magnitude)
    return 1.0 if bool(comfort_checks(signals, n).all()) else 0.0


# ---------------------------------------------------------------------------------------------- aggregation
@dataclass
class ScenarioScore:
    """All metric values of one scenario and its score S in [0, 1]."""

    token: str
    scenario_type: str
    multipliers: dict[str, float]
    weighted: dict[str, float]
    score: float = field(init=False)

    def __post_init__(self) -> None:
        self.score = scenario_score(self.multipliers, self.weighted)


def scenario_score(multipliers: dict[str, float], weighted: dict[str, float]) -> float:
    """Π multipliers × Σ w·m / Σ w over the weighted metrics that have a score (None drops out)."""
    m = float(np.prod([multipliers[k] for k in MULTIPLIERS if multipliers.get(k) is not None]))
    num = sum(WEIGHTS[k] * v for k, v in weighted.items() if v is not None)
    den = sum(WEIGHTS[k] for k, v in weighted.items() if v is not None)
    return m * (num / den if den else 0.0)


def aggregate(scores: list[ScenarioScore]) -> dict[str, float]:
    """Per-type means and the final score (the plain mean over scenarios, which equals Σ_type mean·n / N), plus
    every metric's mean; all in [0, 1] (multiply by 100 for CLS)."""
    if not scores:
        return {"score": float("nan"), "num_scenarios": 0}
    out: dict[str, float] = {"score": float(np.mean([s.score for s in scores])), "num_scenarios": len(scores)}
    for t in sorted({s.scenario_type for s in scores}):
        out[f"type/{t}"] = float(np.mean([s.score for s in scores if s.scenario_type == t]))
    for k in MULTIPLIERS:
        out[f"metric/{k}"] = float(np.mean([s.multipliers[k] for s in scores]))
    for k in WEIGHTS:
        vals = [s.weighted[k] for s in scores if s.weighted.get(k) is not None]
        if vals:
            out[f"metric/{k}"] = float(np.mean(vals))
    return out
