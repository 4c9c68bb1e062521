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
COMFORT_BOUNDS = {"lon_acc": (-4.05, 2.40), "lat_acc": 4.89, "jerk": 8.37, "lon_jerk": 4.13, "yaw_acc": 1.93,
                  "yaw_rate": 0.95}
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
                   obj_yaw: float, obj_half: np.ndarray, obj_speed: float, obj_static: bool) -> str:
    """nuPlan's classification of one collision: STOPPED_EGO, STOPPED_TRACK, ACTIVE_REAR, ACTIVE_FRONT or
    ACTIVE_LATERAL (in that order of precedence)."""
    if ego_speed <= STOPPED_SPEED:
        return "STOPPED_EGO"
    if obj_static or obj_speed <= STOPPED_SPEED:
        return "STOPPED_TRACK"
    rel = np.asarray(obj_xy) - np.asarray(ego_xy)
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


def driving_direction_compliance(lane_progress: np.ndarray, dt: float = 0.1) -> float:
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
def time_to_collision_within_bound(ego_xy: np.ndarray, ego_yaw: np.ndarray, ego_speed: np.ndarray,
                                   ego_half: np.ndarray, obj_xy: np.ndarray, obj_yaw: np.ndarray,
                                   obj_speed: np.ndarray, obj_half: np.ndarray, obj_valid: np.ndarray,
                                   ego_in_intersection: np.ndarray | None = None,
                                   at_fault_collision: np.ndarray | None = None) -> float:
    """1 if the time to collision stays above 0.95 s at every step, else 0.

    ego_* [T] (xy [T, 2]); obj_* [T, N] (xy [T, N, 2], half [T, N, 2]). Ego and objects move at constant speed
    and heading in 0.1 s steps up to 3 s. Only objects ahead (within 30° of the heading) count, or every object not
    behind when the ego is in an intersection. Objects already overlapping the ego are excluded; steps with an
    at-fault collision have TTC 0; TTC stays infinite while the ego is stopped (≤ 0.005 m/s).
    """
    T = len(ego_speed)
    inter = np.zeros(T, bool) if ego_in_intersection is None else np.asarray(ego_in_intersection, bool)
    fault = np.zeros(T, bool) if at_fault_collision is None else np.asarray(at_fault_collision, bool)
    times = np.arange(1, int(round(TTC_HORIZON / TTC_STEP)) + 1) * TTC_STEP
    for t in range(T):
        if fault[t]:
            return 0.0
        if ego_speed[t] <= TTC_STOPPED_SPEED or obj_xy.shape[1] == 0:
            continue
        rel = obj_xy[t] - ego_xy[t]
        ang = np.abs((np.arctan2(rel[:, 1], rel[:, 0]) - ego_yaw[t] + np.pi) % (2 * np.pi) - np.pi)
        relevant = obj_valid[t] & ((ang < TTC_AHEAD_ANGLE) | (inter[t] & (ang < REAR_ANGLE)))
        now = boxes_overlap(box_corners(ego_xy[t], np.asarray(ego_yaw[t]), ego_half)[None],
                            box_corners(obj_xy[t], obj_yaw[t], obj_half[t]))
        relevant &= ~now
        if not relevant.any():
            continue
        ed = np.array([math.cos(ego_yaw[t]), math.sin(ego_yaw[t])])
        od = np.stack([np.cos(obj_yaw[t]), np.sin(obj_yaw[t])], -1)
        idx = np.nonzero(relevant)[0]
        for tau in times:
            if tau > TTC_THRESHOLD + 1e-9:
                break
            e = box_corners(ego_xy[t] + ed * ego_speed[t] * tau, np.asarray(ego_yaw[t]), ego_half)
            o = box_corners(obj_xy[t, idx] + od[idx] * (obj_speed[t, idx] * tau)[:, None], obj_yaw[t, idx],
                            obj_half[t, idx])
            if boxes_overlap(e[None], o).any():
                return 0.0
    return 1.0


def speed_limit_compliance(speed: np.ndarray, limit: np.ndarray, dt: float = 0.1) -> float:
    """1 − Σ(overspeed · dt) / (2.23 m/s · duration), floored at 0; duration = (T − 1) · dt (≥ dt)."""
    speed, limit = np.asarray(speed, np.float64), np.asarray(limit, np.float64)
    over = np.clip(speed - limit, 0.0, None)
    duration = max(len(speed) - 1, 1) * dt
    return max(0.0, 1.0 - float(over.sum() * dt) / (SPEED_VIOLATION_MAX * duration))


def savgol(x: np.ndarray, window: int, order: int, deriv: int, dt: float) -> np.ndarray:
    """Savitzky–Golay filter (least-squares polynomial per window; edges use the first/last full window, as
    scipy's ``mode='interp'``). The window shrinks to the signal length when the signal is shorter.

    Vectorised: the fitted polynomial's ``deriv``-th derivative at offset o of a window is a fixed linear combination
    of the window's samples (a row of the pseudo-inverse of the Vandermonde matrix), so every output is one dot
    product with its window (same values as a per-sample ``np.polyfit``)."""
    x = np.asarray(x, np.float64)
    n = len(x)
    w = min(window, n)
    order = min(order, w - 1)
    if w < 2:
        return np.zeros_like(x) if deriv else x.copy()
    if deriv > order:
        return np.zeros(n)
    t = np.arange(w) * dt
    pinv = np.linalg.pinv(np.vander(t, order + 1, increasing=True))  # [order+1, w]: samples -> coefficients
    j = np.arange(order + 1)
    fact = np.array([math.perm(int(k), deriv) if k >= deriv else 0 for k in j], np.float64)
    powers = np.where(j >= deriv, np.power.outer(t, np.clip(j - deriv, 0, None)), 0.0)  # [w (offset), order+1]
    weights = (powers * fact) @ pinv  # [offset, w]
    half = (w - 1) // 2
    idx = np.arange(n)
    start = np.clip(idx - half, 0, n - w)
    windows = np.lib.stride_tricks.sliding_window_view(x, w)[start]  # [n, w]
    return np.einsum("nw,nw->n", weights[idx - start], windows)


def comfort_signals(speed: np.ndarray, yaw: np.ndarray, dt: float = 0.1,
                    accel: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The six comfort signals at the vehicle centre: acceleration smoothed (window 8, order 2), jerk as its SG
    derivative (15, 2), yaw rate as the SG derivative of the unwrapped heading (15, 2) and yaw acceleration its 2nd
    derivative (15, 3); lateral acceleration = speed · yaw rate."""
    speed = np.asarray(speed, np.float64)
    a_raw = np.gradient(speed, dt) if accel is None else np.asarray(accel, np.float64)
    lon_acc = savgol(a_raw, 8, 2, 0, dt)
    lon_jerk = savgol(lon_acc, 15, 2, 1, dt)
    h = np.unwrap(np.asarray(yaw, np.float64))
    yaw_rate = savgol(h, 15, 2, 1, dt)
    yaw_acc = savgol(h, 15, 3, 2, dt)
    lat_acc = speed * yaw_rate
    lat_jerk = np.gradient(lat_acc, dt) if len(lat_acc) > 1 else np.zeros_like(lat_acc)
    return {"lon_acc": lon_acc, "lat_acc": lat_acc, "jerk": np.hypot(lon_jerk, lat_jerk), "lon_jerk": lon_jerk,
            "yaw_acc": yaw_acc, "yaw_rate": yaw_rate}


def ego_is_comfortable(signals: dict[str, np.ndarray]) -> float:
    """1 if every signal stays within its bound over the whole run, else 0."""
    lo, hi = COMFORT_BOUNDS["lon_acc"]
    ok = bool(np.all((signals["lon_acc"] > lo) & (signals["lon_acc"] < hi)))
    for k in ("lat_acc", "jerk", "lon_jerk", "yaw_acc", "yaw_rate"):
        ok &= bool(np.all(np.abs(signals[k]) < COMFORT_BOUNDS[k]))
    return 1.0 if ok else 0.0


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
