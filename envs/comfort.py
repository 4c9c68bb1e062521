"""nuPlan's six comfort signals and checks, batched in torch: the one implementation that CaRL's nuPlan reward
(:mod:`envs.reward`) and the closed-loop score (:mod:`envs.metrics.nuplan`) share.

What the devkit does (nuplan-devkit ``nuplan/planning/metrics/utils/state_extractors.py``, the metrics
``nuplan/planning/metrics/evaluation_metrics/common/ego_{lon,lat}_acceleration.py``, ``ego_jerk.py``,
``ego_lon_jerk.py``, ``ego_yaw_rate.py``, ``ego_yaw_acceleration.py``; see ``../shared/docs/benchmarks.md`` §10):

========================  =================================================================================
signal                    derivation (scipy ``savgol_filter``, default ``mode='interp'``)
========================  =================================================================================
longitudinal acceleration SG(window 8, order 2) of the centre's body-frame acceleration x, rounded to 8 decimals
lateral acceleration      the same filter on the centre's body-frame acceleration y
jerk (magnitude)          SG derivative (window 15, order 2) of the *filtered* acceleration magnitude, where the
                          magnitude is ``DynamicCarState.acceleration`` = |rear-axle acceleration vector|
longitudinal jerk         SG derivative (window 15, order 2) of the filtered longitudinal acceleration
yaw rate                  SG derivative (window **5**, order 2) of the phase-unwrapped heading
yaw acceleration          SG 2nd derivative (window 5, order 3) of the phase-unwrapped heading
========================  =================================================================================

Windows are ``min(window, number of states)`` (the devkit passes that to scipy). ``extract_ego_yaw_rate`` has a
``window_length=15`` argument but does not forward it to ``approximate_derivatives``, whose default 5 applies. Each
metric holds if ``lo < value < hi`` at every state (strict; ``within_bound_metric_base._compute_within_bound``).

Savitzky-Golay as scipy computes it (``mode='interp'``) for a series of n samples and window w = min(W, n):

* the first ``w // 2`` outputs are the polynomial fitted to the first w samples, evaluated at their positions; the
  last ``w // 2`` likewise with the last w samples;
* every other output i is the polynomial fitted to samples ``i - (w-1)//2 ... i - (w-1)//2 + w - 1`` evaluated at
  the window's middle, position ``(w - 1) / 2``. For an odd w that is sample i. For an even w (the acceleration
  filter's 8) it lies half a sample *after* i: scipy's centred even-length kernel is applied with
  ``ndimage.convolve1d``'s origin, so output i is the fit over samples i-3..i+4 evaluated at i + 0.5. This is what
  the devkit computes (checked numerically against scipy 1.17.1's ``savgol_filter``; the devkit's
  ``requirements_lock.txt`` pins scipy 1.9.1).
* a history shorter than the polynomial order + 1 (w <= order) makes scipy raise ("polyorder must be less than
  window_length"), so the devkit cannot score it; here such outputs are 0 and :func:`comfort_checks` treats rows
  with fewer than ``min_states`` (default 4, what the order-3 yaw-acceleration fit needs; CaRL's threshold) as
  comfortable.

Everything is vectorised over rows (each with its own valid length) and time; only the six signals are looped over.
Padding beyond a row's length is ignored (zeroed before filtering) and the outputs there are 0.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from envs.api import COMFORT_METRICS  # the six signals' names, in order

# devkit filter settings (state_extractors.py defaults as the metrics call them)
ACC_WINDOW, ACC_ORDER = 8, 2  # extract_ego_acceleration
JERK_WINDOW, JERK_ORDER = 15, 2  # extract_ego_jerk (derivative 1)
YAW_WINDOW = 5  # approximate_derivatives' default (extract_ego_yaw_rate does not forward its window_length=15)
YAW_RATE_ORDER, YAW_ACC_ORDER = 2, 3  # ego_yaw_rate (derivative 1), ego_yaw_acceleration (derivative 2)
DECIMALS = 8  # np.round(..., decimals=8) after each extraction
MIN_COMFORT_STATES = 4  # the order-3 fit needs 4 states; CaRL's comfort factor is 1.0 below that
# nuPlan's bounds (low_level/ego_*_statistics.yaml; benchmarks.md §10). Same names and layout as
# envs.metrics.nuplan.COMFORT_BOUNDS: a (min, max) pair for lon_acc, |value| bounds for the others.
COMFORT_BOUNDS: dict[str, float | tuple[float, float]] = {
    "lon_acc": (-4.05, 2.40), "lat_acc": 4.89, "jerk": 8.37, "lon_jerk": 4.13, "yaw_acc": 1.93, "yaw_rate": 0.95}
CENTRE_CONVENTIONS = ("nuplan", "rigid_body")


# ---------------------------------------------------------------------------------------------- Savitzky-Golay
@functools.lru_cache(maxsize=64)
def _sg_table(window: int, order: int, deriv: int) -> np.ndarray:
    """Least-squares weights ``[w, slot, k]`` (float64, w = 0..window, slot = 0..window): the ``deriv``-th
    derivative (per sample, not yet divided by delta**deriv) at position ``slot`` of the order-``order`` polynomial
    fitted to a window of ``w`` samples, as a linear combination of the samples k = 0..w-1. Slot ``window`` holds
    the window's middle, (w - 1) / 2. Windows too short for the order (w <= order) have zero weights."""
    table = np.zeros((window + 1, window + 1, window), np.float64)
    for w in range(order + 1, window + 1):
        c0 = (w - 1) / 2.0  # centre the abscissa for conditioning; the fit is the same
        t = np.arange(w, dtype=np.float64) - c0
        pinv = np.linalg.pinv(np.vander(t, order + 1, increasing=True))  # [order+1, w]: samples -> coefficients
        positions = [float(p) for p in range(w)] + [0.0] * (window - w) + [c0]
        for slot, p in enumerate(positions):
            if slot >= w and slot != window:
                continue
            u = p - c0
            row = np.array([math.perm(j, deriv) * u ** (j - deriv) if j >= deriv else 0.0 for j in range(order + 1)])
            table[w, slot, :w] = row @ pinv
    return table


def savgol(x: Tensor, n: Tensor, window: int, order: int, deriv: int = 0, delta: float = 1.0) -> Tensor:
    """scipy's ``savgol_filter(x[b, :n[b]], window_length=min(window, n[b]), polyorder=order, deriv=deriv,
    delta=delta)`` (``mode='interp'``) for every row b of ``x`` [B, T] at once; ``n`` [B] valid lengths. Outputs at
    ``i >= n[b]`` are 0, and so is every output of a row with ``min(window, n[b]) <= order`` (scipy raises there).
    Keeps the dtype and device of ``x``."""
    if x.dim() != 2:
        raise ValueError(f"savgol expects x of shape [B, T]; got {tuple(x.shape)}")
    B, T = x.shape
    dev = x.device
    n = torch.as_tensor(n, device=dev).long().clamp(0, T)
    i = torch.arange(T, device=dev)
    valid = i[None, :] < n[:, None]  # [B, T]
    x = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=dev))
    if T == 0:
        return x
    table = torch.as_tensor(_sg_table(window, order, deriv), dtype=x.dtype, device=dev)
    w = n.clamp(max=window)  # [B]
    half = (w // 2)[:, None]
    nn, ww = n[:, None], w[:, None]
    left = i[None, :] < half
    right = i[None, :] >= nn - half
    start = torch.where(left, torch.zeros_like(i)[None, :],
                        torch.where(right, nn - ww, i[None, :] - (ww - 1) // 2))  # [B, T]
    slot = torch.where(left | right, i[None, :] - start, torch.full_like(start, window))
    start = torch.where(valid, start, torch.zeros_like(start))
    slot = torch.where(valid, slot, torch.full_like(slot, window))
    k = torch.arange(window, device=dev)
    idx = (start[:, :, None] + k).clamp(0, T - 1)  # [B, T, window]; weights are 0 beyond the row's window
    samples = torch.gather(x, 1, idx.reshape(B, -1)).reshape(B, T, window)
    weights = table[ww.expand(B, T), slot]  # [B, T, window]
    out = (samples * weights).sum(-1)
    if deriv:
        out = out / (delta ** deriv)
    return torch.where(valid, out, torch.zeros_like(out))


def phase_unwrap(heading: Tensor) -> Tensor:
    """The devkit's ``phase_unwrap`` along the last dim: subtract 2π · cumsum(round(Δheading / 2π))."""
    two_pi = 2.0 * math.pi
    steps = torch.round(torch.diff(heading, dim=-1) / two_pi)
    adjust = torch.cat((torch.zeros_like(heading[..., :1]), torch.cumsum(steps, dim=-1)), dim=-1)
    return heading - two_pi * adjust


def _round(x: Tensor, decimals: int | None) -> Tensor:
    return x if decimals is None else torch.round(x, decimals=decimals)


# ---------------------------------------------------------------------------------------------- signals and checks
def comfort_signals(lon_acc: Tensor, lat_acc: Tensor, heading: Tensor, n: Tensor, dt: float,
                    acc_magnitude: Tensor | None = None, decimals: int | None = DECIMALS) -> dict[str, Tensor]:
    """The six comfort signals [B, T] (keys :data:`COMFORT_METRICS`) as the devkit derives them from each row's
    first ``n[b]`` states.

    ``lon_acc``, ``lat_acc`` [B, T]: the centre's body-frame acceleration (``center_acceleration_2d``; see
    :func:`rear_axle_to_center_acceleration`); ``heading`` [B, T] rad (wrapped or not); ``dt`` the (constant)
    state spacing in s. ``acc_magnitude`` [B, T]: what the jerk-magnitude metric differentiates, the devkit's
    ``DynamicCarState.acceleration`` = |rear-axle acceleration vector| (third output of
    :func:`rear_axle_to_center_acceleration`); ``None`` uses hypot(lon_acc, lat_acc) of the centre instead (differs
    from the devkit by the rigid-body terms). ``decimals``: the devkit's rounding (``None`` skips it)."""
    x = lon_acc
    hist = {"lon_acc": lon_acc, "lat_acc": lat_acc, "heading": heading}
    for name, v in hist.items():
        if v.shape != x.shape or v.dim() != 2:
            raise ValueError(f"comfort_signals: {name} has shape {tuple(v.shape)}; every history must be [B, T] "
                             f"like lon_acc {tuple(x.shape)}")
    mag = torch.hypot(lon_acc, lat_acc) if acc_magnitude is None else acc_magnitude
    lon_f = _round(savgol(lon_acc, n, ACC_WINDOW, ACC_ORDER), decimals)
    lat_f = _round(savgol(lat_acc, n, ACC_WINDOW, ACC_ORDER), decimals)
    mag_f = _round(savgol(mag, n, ACC_WINDOW, ACC_ORDER), decimals)
    h = phase_unwrap(heading)
    return {
        "lon_acc": lon_f,
        "lat_acc": lat_f,
        "jerk": _round(savgol(mag_f, n, JERK_WINDOW, JERK_ORDER, 1, dt), decimals),
        "lon_jerk": _round(savgol(lon_f, n, JERK_WINDOW, JERK_ORDER, 1, dt), decimals),
        "yaw_rate": _round(savgol(h, n, YAW_WINDOW, YAW_RATE_ORDER, 1, dt), decimals),
        "yaw_acc": _round(savgol(h, n, YAW_WINDOW, YAW_ACC_ORDER, 2, dt), decimals),
    }


def _bounds(bounds: Mapping[str, float | tuple[float, float]], name: str) -> tuple[float, float]:
    b = bounds[name]
    if isinstance(b, (tuple, list)):
        return float(b[0]), float(b[1])
    return -float(b), float(b)


def comfort_checks(signals: Mapping[str, Tensor], n: Tensor,
                   bounds: Mapping[str, float | tuple[float, float]] = COMFORT_BOUNDS,
                   min_states: int = MIN_COMFORT_STATES) -> Tensor:
    """Which of the six checks hold over each row's whole valid history: bool [B, 6] in :data:`COMFORT_METRICS`
    order; a check holds if ``lo < value < hi`` at every state i < n[b] (nuPlan's strict bounds). Rows with fewer
    than ``min_states`` states pass every check (the devkit cannot score them; CaRL's factor is 1.0 there).
    ``ego_is_comfortable`` is ``comfort_checks(...).all(-1)``."""
    first = signals[COMFORT_METRICS[0]]
    T = first.shape[-1]
    n = torch.as_tensor(n, device=first.device).long()
    pad = torch.arange(T, device=first.device)[None, :] >= n[:, None]
    out = []
    for name in COMFORT_METRICS:  # a loop over the six signals only
        lo, hi = _bounds(bounds, name)
        v = signals[name]
        out.append(((v > lo) & (v < hi) | pad).all(-1))
    return torch.stack(out, -1) | (n < min_states)[:, None]


# ---------------------------------------------------------------------------------------------- rear axle -> centre
class CentreAcceleration(NamedTuple):
    lon: Tensor  # centre's body-frame acceleration along the heading, m/s²
    lat: Tensor  # ... to the left
    rear_magnitude: Tensor  # |rear-axle acceleration vector|: the devkit's DynamicCarState.acceleration


def rear_axle_to_center_acceleration(accel: Tensor, yaw_rate: Tensor, yaw_acc: Tensor, rear_axle_to_center: float,
                                     speed: Tensor | None = None, lateral_accel: Tensor | None = None,
                                     convention: str = "nuplan") -> CentreAcceleration:
    """The centre's body-frame acceleration from the rear axle's state (all tensors broadcast together).

    ``accel``: the rear axle's acceleration along the heading; ``yaw_rate`` ω, ``yaw_acc`` α;
    ``rear_axle_to_center`` d (m, > 0, the centre lies d ahead of the rear axle).

    * ``"nuplan"`` (default): exactly what the devkit's ``DynamicCarState.center_acceleration_2d`` returns
      (``nuplan/common/actor_state/dynamic_car_state.py``, ``get_acceleration_shifted`` with displacement (d, 0)):
      ``a_centre = a_rear + (d, 0)·ω² + (d, 0)·α``, i.e. lon = a + d(ω² + α), lat = the rear axle's lateral
      acceleration unchanged. ``lateral_accel`` is that rear-axle lateral acceleration; ``None`` = 0, which is what
      nuPlan's kinematic bicycle stores (``rear_axle_acceleration_2d = (a, 0)``), so in closed-loop simulation the
      devkit's lateral acceleration is 0. This is *not* the physical rigid-body transfer (wrong sign of the
      centripetal term, angular term on the wrong axis); it is what nuPlan scores.
    * ``"rigid_body"``: the physical transfer a_c = a_r + α × r − ω² r with r = (d, 0): lon = a − dω²,
      lat = a_r,lat + dα, where the rear axle's lateral acceleration is ``lateral_accel`` or, if ``None``,
      ``speed · ω`` (no lateral slip at the rear axle; needs ``speed``). On a circle at constant speed this is the
      centre's centripetal acceleration v_c² / R_c towards the circle's centre.

    ``rear_magnitude`` = |(a, a_r,lat)| under the same convention (the jerk-magnitude metric's input)."""
    if convention not in CENTRE_CONVENTIONS:
        raise ValueError(f"convention={convention!r}: use one of {', '.join(CENTRE_CONVENTIONS)}")
    d = float(rear_axle_to_center)
    if convention == "nuplan":
        lat_rear = torch.zeros_like(accel) if lateral_accel is None else lateral_accel
        lon = accel + d * (yaw_rate ** 2 + yaw_acc)
        lat = lat_rear + torch.zeros_like(lon)
    else:
        if lateral_accel is None:
            if speed is None:
                raise ValueError("rear_axle_to_center_acceleration(convention='rigid_body') needs speed (the rear "
                                 "axle's lateral acceleration is speed * yaw_rate) or lateral_accel")
            lat_rear = speed * yaw_rate
        else:
            lat_rear = lateral_accel
        lon = accel - d * yaw_rate ** 2
        lat = lat_rear + d * yaw_acc
    return CentreAcceleration(lon, lat, torch.hypot(accel, lat_rear + torch.zeros_like(accel)))
