"""CaRL's nuPlan reward (carl-reference.md §18) and nuPlan's comfort signals (benchmarks.md §10), hand-computed.

Every expectation comes from the formulas (or, for Savitzky-Golay, from a direct numpy.polyfit least-squares fit
written here), never from the code under test.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from envs.comfort import (COMFORT_BOUNDS, comfort_checks, comfort_signals, phase_unwrap,
                          rear_axle_to_center_acceleration, savgol)
from envs.config import ConfigError
from envs.reward import (COMFORT_METRICS, NuplanRewardConfig, NuplanRewardInputs, NuplanRewardState, RewardConfig,
                         RewardInputs, RewardState, compute_reward, non_stationary_collision)

DT = 0.1


# ---------------------------------------------------------------------------------------------- Savitzky-Golay
def polyfit_savgol(x: np.ndarray, window: int, order: int, deriv: int, dt: float) -> np.ndarray:
    """scipy's mode='interp' rule written out with numpy.polyfit: window w = min(window, n); the first/last w // 2
    outputs evaluate the fit of the first/last w samples at their own positions; output i otherwise evaluates the
    fit of samples i-(w-1)//2 ... at the window's middle (w-1)/2 (half a sample after i for an even w)."""
    n = len(x)
    w = min(window, n)
    half = w // 2
    out = np.zeros(n)
    for i in range(n):
        if i < half:
            s, p = 0, float(i)
        elif i >= n - half:
            s, p = n - w, float(i - (n - w))
        else:
            s, p = i - (w - 1) // 2, (w - 1) / 2
        coef = np.polyfit(np.arange(w, dtype=float), x[s:s + w], order)
        out[i] = np.polyval(np.polyder(coef, deriv), p) / dt ** deriv
    return out


@pytest.mark.parametrize("window,order,deriv", [(8, 2, 0), (15, 2, 1), (5, 2, 1), (5, 3, 2)])
def test_savgol_matches_a_least_squares_polynomial_fit_per_row(window, order, deriv):
    rng = np.random.default_rng(window * 10 + deriv)
    lengths = [30, 16, 9, 7, 4]  # rows with their own histories; short ones use the whole row as the window
    x = rng.normal(size=(len(lengths), 30))
    got = savgol(torch.tensor(x), torch.tensor(lengths), window, order, deriv, DT).numpy()
    for b, n in enumerate(lengths):
        want = polyfit_savgol(x[b, :n], window, order, deriv, DT)
        np.testing.assert_allclose(got[b, :n], want, rtol=1e-9, atol=1e-9 / DT ** deriv)
        assert np.all(got[b, n:] == 0.0)


def test_even_window_evaluates_half_a_sample_late_inside_and_on_the_samples_at_the_edges():
    # a ramp is fitted exactly by a quadratic, so every output is the ramp at its evaluation position
    x = torch.arange(20, dtype=torch.float64)[None]
    got = savgol(x, torch.tensor([20]), 8, 2)[0].tolist()
    want = [i + (0.5 if 4 <= i <= 15 else 0.0) for i in range(20)]
    assert got == pytest.approx(want, abs=1e-9)


def test_savgol_rows_too_short_for_the_order_are_zero():
    x = torch.ones(2, 6, dtype=torch.float64)
    got = savgol(x, torch.tensor([3, 4]), 5, 3, 2, DT)  # order 3 needs 4 samples (scipy raises below)
    assert got[0].tolist() == [0.0] * 6
    assert got[1, :4].tolist() == pytest.approx([0.0] * 4, abs=1e-9)  # constant -> zero 2nd derivative


def test_savgol_keeps_float32():
    x = torch.arange(10, dtype=torch.float32)[None] * 0.3
    got = savgol(x, torch.tensor([10]), 5, 2, 1, DT)
    assert got.dtype == torch.float32 and got[0].tolist() == pytest.approx([3.0] * 10, rel=1e-5)


# ---------------------------------------------------------------------------------------------- comfort signals
def histories(lon, lat, heading, mag=None):
    as_t = lambda v: torch.as_tensor(np.asarray(v, np.float64))[None]
    return as_t(lon), as_t(lat), as_t(heading), None if mag is None else as_t(mag)


def test_constant_acceleration_and_yaw_rate_in_closed_form():
    n = 40
    t = np.arange(n) * DT
    a_lon, a_lat, omega = -1.5, 0.7, 0.4
    heading = (2.9 + omega * t + math.pi) % (2 * math.pi) - math.pi  # wraps through ±π
    lon, lat, h, _ = histories(np.full(n, a_lon), np.full(n, a_lat), heading)
    sig = comfort_signals(lon, lat, h, torch.tensor([n]), DT)
    assert sig["lon_acc"][0].tolist() == pytest.approx([a_lon] * n, abs=1e-8)
    assert sig["lat_acc"][0].tolist() == pytest.approx([a_lat] * n, abs=1e-8)
    assert sig["lon_jerk"][0].tolist() == pytest.approx([0.0] * n, abs=1e-6)
    assert sig["jerk"][0].tolist() == pytest.approx([0.0] * n, abs=1e-6)  # constant magnitude hypot(a_lon, a_lat)
    assert sig["yaw_rate"][0].tolist() == pytest.approx([omega] * n, abs=1e-6)
    assert sig["yaw_acc"][0].tolist() == pytest.approx([0.0] * n, abs=1e-5)


def test_quadratic_heading_gives_linear_yaw_rate_and_constant_yaw_acceleration():
    n = 25
    t = np.arange(n) * DT
    omega0, alpha = -0.3, 0.8
    heading = 0.2 + omega0 * t + 0.5 * alpha * t ** 2
    z = np.zeros(n)
    lon, lat, h, _ = histories(z, z, heading)
    sig = comfort_signals(lon, lat, h, torch.tensor([n]), DT)
    assert sig["yaw_rate"][0].tolist() == pytest.approx(list(omega0 + alpha * t), abs=1e-6)
    assert sig["yaw_acc"][0].tolist() == pytest.approx([alpha] * n, abs=1e-5)


def test_jerk_of_an_acceleration_ramp_inside_the_windows():
    # a(t) = a0 + J t; the window-8 filter reproduces it (half a sample late inside); the jerk windows (15) that lie
    # wholly inside that region see a straight line of slope J
    n, a0, J = 40, 0.5, 1.2
    t = np.arange(n) * DT
    acc = a0 + J * t
    lon, lat, h, mag = histories(acc, np.zeros(n), np.zeros(n), np.abs(acc))
    sig = comfort_signals(lon, lat, h, torch.tensor([n]), DT, acc_magnitude=mag)
    want_acc = [a0 + J * (ti + (DT / 2 if 4 <= i <= n - 5 else 0.0)) for i, ti in enumerate(t)]
    assert sig["lon_acc"][0].tolist() == pytest.approx(want_acc, abs=1e-8)
    inner = slice(4 + 7, n - 5 - 7 + 1)
    assert sig["lon_jerk"][0, inner].tolist() == pytest.approx([J] * len(range(n)[inner]), abs=1e-5)
    assert sig["jerk"][0, inner].tolist() == pytest.approx([J] * len(range(n)[inner]), abs=1e-5)


def test_jerk_follows_the_devkit_chain_everywhere():
    # jerk = SG'(15, 2) of round(SG(8, 2) of the acceleration, 8 decimals), written out with polyfit
    rng = np.random.default_rng(3)
    n = 33
    acc = rng.normal(size=n)
    lon, lat, h, _ = histories(acc, np.zeros(n), np.zeros(n))
    sig = comfort_signals(lon, lat, h, torch.tensor([n]), DT)
    filtered = np.round(polyfit_savgol(acc, 8, 2, 0, DT), 8)
    want = np.round(polyfit_savgol(filtered, 15, 2, 1, DT), 8)
    np.testing.assert_allclose(sig["lon_jerk"][0].numpy(), want, atol=2e-8)


def test_phase_unwrap_removes_two_pi_jumps():
    h = torch.tensor([[3.0, -3.0, -2.9, 3.1]], dtype=torch.float64)
    two_pi = 2 * math.pi
    assert phase_unwrap(h)[0].tolist() == pytest.approx([3.0, -3.0 + two_pi, -2.9 + two_pi, 3.1], abs=1e-12)


def test_checks_are_strict_and_cover_only_the_valid_history():
    T = 6
    ok = {k: torch.zeros(3, T) for k in COMFORT_METRICS}
    ok["lon_acc"][0, 2] = 2.40  # on the bound: fails (strict)
    ok["yaw_rate"][0, 1] = -0.95  # on the bound: fails
    ok["jerk"][1, 5] = 100.0  # beyond row 1's valid length 5: ignored
    ok["lat_acc"][1, 0] = 4.88  # inside
    ok["lon_jerk"][2, 0] = 50.0  # row 2 has only 3 states: every check holds
    got = comfort_checks(ok, torch.tensor([6, 5, 3]))
    assert got[0].tolist() == [False, True, True, True, False, True]
    assert got[1].tolist() == [True] * 6 and got[2].tolist() == [True] * 6
    assert COMFORT_METRICS == ("lon_acc", "lat_acc", "jerk", "lon_jerk", "yaw_rate", "yaw_acc")
    assert COMFORT_BOUNDS == {"lon_acc": (-4.05, 2.40), "lat_acc": 4.89, "jerk": 8.37, "lon_jerk": 4.13,
                              "yaw_acc": 1.93, "yaw_rate": 0.95}


# ---------------------------------------------------------------------------------------------- rear axle -> centre
def test_rigid_body_transfer_on_a_circle_is_the_centres_centripetal_acceleration():
    R, v, d, t0 = 10.0, 5.0, 1.461, 0.7  # rear axle on a circle of radius R (left turn) at speed v
    omega = v / R

    def centre(t):  # rear axle at O + R (sin θ, -cos θ) with θ = ωt the heading; centre d ahead of it
        th = omega * t
        return np.array([R * math.sin(th) + d * math.cos(th), -R * math.cos(th) + d * math.sin(th)])

    h = 1e-3
    acc_world = (centre(t0 + h) - 2 * centre(t0) + centre(t0 - h)) / h ** 2
    th = omega * t0
    want_lon = math.cos(th) * acc_world[0] + math.sin(th) * acc_world[1]
    want_lat = -math.sin(th) * acc_world[0] + math.cos(th) * acc_world[1]
    one = lambda x: torch.tensor([x], dtype=torch.float64)
    got = rear_axle_to_center_acceleration(one(0.0), one(omega), one(0.0), d, speed=one(v), convention="rigid_body")
    assert float(got.lon) == pytest.approx(want_lon, rel=1e-5)
    assert float(got.lat) == pytest.approx(want_lat, rel=1e-5)
    r_c = math.hypot(R, d)
    assert math.hypot(float(got.lon), float(got.lat)) == pytest.approx((omega * r_c) ** 2 / r_c, rel=1e-9)
    assert float(got.rear_magnitude) == pytest.approx(v ** 2 / R)


def test_nuplan_transfer_is_the_devkits_formula():
    # DynamicCarState.center_acceleration_2d = rear + (d, 0)·ω² + (d, 0)·α; the bicycle's rear lateral acc is 0
    one = lambda x: torch.tensor([x], dtype=torch.float64)
    got = rear_axle_to_center_acceleration(one(1.0), one(0.5), one(0.2), 1.461)
    assert float(got.lon) == pytest.approx(1.0 + 1.461 * (0.25 + 0.2))
    assert float(got.lat) == 0.0 and float(got.rear_magnitude) == 1.0
    got = rear_axle_to_center_acceleration(one(-2.0), one(0.0), one(0.0), 1.461, lateral_accel=one(1.5))
    assert (float(got.lon), float(got.lat), float(got.rear_magnitude)) == pytest.approx((-2.0, 1.5, 2.5))
    # rigid body with an angular acceleration: lateral gains d·α
    got = rear_axle_to_center_acceleration(one(0.0), one(0.0), one(0.3), 2.0, speed=one(4.0), convention="rigid_body")
    assert (float(got.lon), float(got.lat)) == pytest.approx((0.0, 0.6))
    with pytest.raises(ValueError, match="needs speed"):
        rear_axle_to_center_acceleration(one(0.0), one(0.0), one(0.0), 1.0, convention="rigid_body")


# ---------------------------------------------------------------------------------------------- the reward
def cfg(**kw) -> RewardConfig:
    return RewardConfig(mode="carl_nuplan", nuplan=NuplanRewardConfig(**kw))


def state(batch=1, objects=3, history=64) -> NuplanRewardState:
    return NuplanRewardState.zeros(batch, torch.device("cpu"), objects, history)


def inputs(**kw) -> NuplanRewardInputs:
    t, f = torch.tensor([True]), torch.tensor([False])
    base = dict(rc=torch.tensor([0.1]), off_road=f, on_lane=f, lane_center_dist=torch.tensor([0.0]),
                lane_boundary_dist=torch.tensor([1.0]), speed=torch.tensor([5.0]), speed_limit=torch.tensor([10.0]),
                ego_in_route=t, expert_in_route=t, ttc_violation=f, lon_acc=torch.tensor([0.0]),
                lat_acc=torch.tensor([0.0]), heading=torch.tensor([0.0]))
    base.update({k: torch.tensor([v]) if isinstance(v, (bool, float, int)) else v for k, v in kw.items()})
    return NuplanRewardInputs(**base)


def step(c, st, **kw):
    terms = compute_reward(inputs(**kw), st, c)
    return float(terms.reward[0]), terms


def test_progress_is_the_gain_over_the_best_rc_times_100():
    c, st = cfg(), state()
    got = [step(c, st, rc=rc)[0] for rc in (0.1, 0.3, 0.2, 0.35, 1.0, 0.9)]
    assert got == pytest.approx([10.0, 20.0, 0.0, 5.0, 65.0, 0.0], abs=1e-5)
    assert sum(got) == pytest.approx(100.0, abs=1e-4)  # Σ ΔRC <= 1


def test_lane_distance_factor():
    c = cfg()
    # n = (1.5 - 0.5) / (1.5 + 0.5 - 0.5 + 1e-6); factor = 1 - 0.5 n
    n = 1.0 / (1.5 + 1e-6)
    assert step(c, state(), on_lane=True, lane_center_dist=1.5, lane_boundary_dist=0.5)[0] == pytest.approx(
        10.0 * (1 - 0.5 * n), rel=1e-6)
    assert step(c, state(), on_lane=True, lane_center_dist=0.3, lane_boundary_dist=1.2)[0] == pytest.approx(10.0)
    assert step(c, state(), on_lane=True, lane_center_dist=9.0, lane_boundary_dist=0.0)[0] == pytest.approx(
        10.0 * 0.5, rel=1e-5)
    assert step(c, state(), on_lane=False, lane_center_dist=1.5, lane_boundary_dist=0.5)[0] == pytest.approx(10.0)


def test_too_fast_factor():
    c = cfg()
    assert step(c, state(), speed=11.115)[0] == pytest.approx(10.0 * (1 - 1.115 / 2.23), rel=1e-5)
    assert step(c, state(), speed=20.0)[0] == 0.0
    assert step(c, state(), speed=20.0, speed_limit=float("nan"))[0] == pytest.approx(10.0)  # no limit
    assert step(c, state(), speed=9.0)[0] == pytest.approx(10.0)


def test_off_route_factor():
    c = cfg()
    assert step(c, state(), ego_in_route=False, expert_in_route=True)[0] == 0.0
    assert step(c, state(), ego_in_route=False, expert_in_route=False)[0] == pytest.approx(10.0)
    assert step(c, state(), ego_in_route=True, expert_in_route=False)[0] == pytest.approx(10.0)


def test_comfort_factor_counts_passing_checks_from_the_fourth_state():
    c, st = cfg(), state()
    # lon acc 3.0 > 2.40 fails; its magnitude is constant, so both jerks are 0; yaw rate 1.0 > 0.95 fails
    got = [step(c, st, rc=0.1 * (k + 1), lon_acc=3.0, heading=1.0 * DT * k)[1].factors["comfort"].item()
           for k in range(5)]
    assert got[:3] == [1.0, 1.0, 1.0]
    assert got[3:] == pytest.approx([4 / 6, 4 / 6])
    checks = step(c, st, rc=0.6, lon_acc=3.0, heading=0.5)[1].factors["comfort_checks"][0].tolist()
    assert checks == [False, True, True, True, False, True]


def test_the_initial_state_counts_towards_the_four():
    c, st = cfg(), state()
    st.record_state(torch.tensor([3.0]), torch.tensor([0.0]), torch.tensor([0.0]))
    got = [step(c, st, rc=0.1 * (k + 1), lon_acc=3.0)[1].factors["comfort"].item() for k in range(3)]
    assert got == pytest.approx([1.0, 1.0, 5 / 6])


def test_ttc_is_sticky_and_ignored_when_stopped():
    c, st = cfg(), state()
    got = [step(c, st, rc=0.1 * (k + 1), ttc_violation=(k == 1))[0] for k in range(4)]
    assert got == pytest.approx([10.0, 5.0, 5.0, 5.0], abs=1e-5)
    st = state()
    assert step(c, st, ttc_violation=True, speed=0.005)[1].factors["ttc"].item() == 1.0
    assert step(c, st, rc=0.2, ttc_violation=False)[1].factors["ttc"].item() == 1.0


def test_non_stationary_collision_rule():
    overlap = torch.tensor([[True, False, False]])
    none = torch.zeros(1, 3, dtype=torch.bool)
    hit, mem = non_stationary_collision(overlap, torch.tensor([0.04]), none)
    assert not bool(hit[0]) and mem.tolist() == [[True, False, False]]  # stationary: no collision, remembered
    hit, mem = non_stationary_collision(overlap, torch.tensor([5.0]), mem)
    assert not bool(hit[0])  # the same object again: ignored
    hit, mem = non_stationary_collision(torch.tensor([[True, True, False]]), torch.tensor([0.05]), mem)
    assert bool(hit[0]) and mem.tolist() == [[True, True, False]]  # a new object at exactly 0.05 m/s


def test_hard_constraints_terminate_with_zero_reward():
    c = cfg()
    for kw in (dict(off_road=True), dict(collision=True), dict(red_light=True),
               dict(overlap=torch.tensor([[False, True, False]]))):
        r, terms = step(c, state(), rc=0.5, **kw)
        assert r == 0.0 and bool(terms.terminated[0]), kw
    r, terms = step(c, state(), rc=0.5, overlap=torch.tensor([[False, True, False]]), speed=0.0)
    assert r == pytest.approx(50.0) and not bool(terms.terminated[0])  # stationary contact
    st = state()
    step(c, st, overlap=torch.tensor([[True, False, False]]), speed=0.0)
    r, terms = step(c, st, rc=0.2, overlap=torch.tensor([[True, False, False]]))  # remembered object
    assert r == pytest.approx(10.0) and not bool(terms.terminated[0])


def test_terminal_penalties_are_scaled_and_picked_by_the_cause():
    c = cfg(terminal_penalty=-0.5, collision_terminal_penalty=-1.0)
    assert step(c, state(), collision=True, off_road=True)[0] == pytest.approx(-100.0)
    assert step(c, state(), off_road=True)[0] == pytest.approx(-50.0)
    assert step(c, state())[0] == pytest.approx(10.0)  # no penalty while the episode goes on


def test_survival_accumulation():
    c = cfg(accumulation="survival")  # ρ = 0.2 (yaml)
    speeding = 1 - 1.115 / 2.23
    want = 100 * ((1 - 0.2) * 0.1 * speeding + 0.2 / 150)
    assert step(c, state(), speed=11.115)[0] == pytest.approx(want, rel=1e-5)
    assert step(c, state(), off_road=True)[0] == 0.0


def test_nuplan_accumulation():
    c = cfg(accumulation="nuplan")
    speeding = 1 - 1.115 / 2.23
    n = 1.0 / (1.5 + 1e-6)
    lane = 1 - 0.5 * n
    want = 100 * lane * (5 * 0.1 + 5 * 1 / 150 + 4 * speeding / 150 + 2 * 1 / 150) / 16
    got = step(c, state(), speed=11.115, on_lane=True, lane_center_dist=1.5, lane_boundary_dist=0.5)[0]
    assert got == pytest.approx(want, rel=1e-5)
    st = state()
    step(c, st, ttc_violation=True)  # ttc fails (sticky): its term drops out, progress is not scaled by it
    want = 100 * (5 * 0.1 + 0 + 4 * 1 / 150 + 2 * 1 / 150) / 16
    assert step(c, st, rc=0.2)[0] == pytest.approx(want, rel=1e-5)
    assert step(c, state(), ego_in_route=False)[0] == 0.0  # off_route multiplies everything
    assert step(c, state(), collision=True)[0] == 0.0


def test_terminal_comfort_and_ttc_accumulation():
    c = cfg(ttc_accumulation="terminal")
    r, terms = step(c, state(), ttc_violation=True)
    assert r == 0.0 and bool(terms.terminated[0])
    c, st = cfg(comfort_accumulation="terminal"), state()
    ends = [bool(step(c, st, rc=0.1 * (k + 1), lon_acc=-5.0)[1].terminated[0]) for k in range(4)]
    assert ends == [False, False, False, True]


def test_rows_are_independent_and_reset_per_episode():
    c, st = cfg(), state(batch=2)
    two = lambda a, b: torch.tensor([a, b])
    f2 = torch.tensor([False, False])
    base = dict(off_road=f2, on_lane=f2, lane_center_dist=two(0.0, 0.0), lane_boundary_dist=two(1.0, 1.0),
                speed=two(5.0, 5.0), speed_limit=two(10.0, 10.0), ego_in_route=~f2, expert_in_route=~f2,
                lat_acc=two(0.0, 0.0), heading=two(0.0, 0.0))
    for k in range(4):
        terms = compute_reward(NuplanRewardInputs(rc=two(0.1 * (k + 1), 0.05 * (k + 1)), lon_acc=two(0.0, -6.0),
                                                  ttc_violation=torch.tensor([k == 0, False]), **base), st, c)
    # row 0: sticky TTC since its first step, comfortable; row 1: lon acc -6 < -4.05 fails one check
    assert terms.factors["ttc"].tolist() == [0.5, 1.0]
    assert terms.factors["comfort"].tolist() == pytest.approx([1.0, 5 / 6])
    assert terms.reward.tolist() == pytest.approx([100 * 0.1 * 0.5, 100 * 0.05 * 5 / 6], rel=1e-5)
    st.reset(torch.tensor([True, False]))
    assert st.rc_best.tolist() == pytest.approx([0.0, 0.2]) and st.count.tolist() == [0, 4]
    assert st.ttc_failed.tolist() == [False, False]
    terms = compute_reward(NuplanRewardInputs(rc=two(0.1, 0.25), lon_acc=two(0.0, -6.0),
                                              ttc_violation=f2, **base), st, c)
    assert terms.reward.tolist() == pytest.approx([10.0, 100 * 0.05 * 5 / 6], rel=1e-5)


def test_a_full_history_drops_its_oldest_state():
    st = state(history=4)
    for k in range(6):
        st.record_state(torch.tensor([float(k)]), torch.tensor([0.0]), torch.tensor([0.0]))
    assert st.acc_lon[0].tolist() == [2.0, 3.0, 4.0, 5.0] and st.count.tolist() == [4]


def test_modes_and_inputs_must_match():
    with pytest.raises(TypeError, match="carl_nuplan"):
        compute_reward(inputs(), state(), RewardConfig())
    carla = RewardInputs(progress=torch.tensor([0.5]), outside_lanes=torch.tensor([False]), speed=torch.tensor([5.0]),
                         speed_limit=torch.tensor([10.0]), ttc_violation=torch.tensor([False]),
                         comfort_violation=torch.zeros(1, 6, dtype=torch.bool), lane_offset_ratio=torch.tensor([0.0]),
                         terminal_penalty=torch.tensor([False]))
    with pytest.raises(TypeError, match="NuplanRewardInputs"):
        compute_reward(carla, RewardState.zeros(1, torch.device("cpu")), cfg())
    assert compute_reward(carla, RewardState.zeros(1, torch.device("cpu")), RewardConfig()).terminated is None


def test_config_defaults_and_validation_name_every_problem():
    c = NuplanRewardConfig()
    assert (c.accumulation, c.reward_factor, c.survival_ratio, c.lane_distance_threshold, c.speeding_margin,
            c.ttc_factor, c.ttc_stopped_speed, c.collision_stopped_speed, c.comfort_min_states) == (
        "regular", 100.0, 0.2, 0.5, 2.23, 0.5, 0.005, 0.05, 4)
    RewardConfig().validate()
    cfg().validate()
    with pytest.raises(ConfigError) as err:
        RewardConfig(mode="nuplan", nuplan=NuplanRewardConfig(accumulation="sum", survival_ratio=1.5,
                                                              comfort_min_states=3, speeding_margin=0.0)).validate()
    msg = str(err.value)
    for key in ("reward.mode", "reward.nuplan.accumulation", "reward.nuplan.survival_ratio",
                "reward.nuplan.comfort_min_states", "reward.nuplan.speeding_margin"):
        assert key in msg
