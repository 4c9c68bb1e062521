"""nuPlan closed-loop score: hand-computed cases for every multiplier and weighted metric."""
import math

import numpy as np
import pytest

import torch

from envs.metrics import nuplan as M
from envs.nuplan.scoring import ttc_violation

pytestmark = pytest.mark.nuplan
EGO_HALF = np.array([2.588, 1.1485])
CAR_HALF = np.array([2.4, 1.0])


def test_collision_classification_and_fault():
    ego = (np.zeros(2), 0.0, EGO_HALF)
    # ego stopped -> STOPPED_EGO (never at fault)
    assert M.collision_type(*ego, 0.0, np.array([4.0, 0.0]), 0.0, CAR_HALF, 5.0, False) == "STOPPED_EGO"
    # object static -> STOPPED_TRACK (at fault)
    kind = M.collision_type(*ego, 3.0, np.array([4.5, 0.0]), 0.0, CAR_HALF, 0.0, False)
    assert kind == "STOPPED_TRACK" and M.is_at_fault(kind, False)
    # moving object behind (180° from the heading) -> ACTIVE_REAR, not at fault
    kind = M.collision_type(*ego, 3.0, np.array([-4.5, 0.0]), 0.0, CAR_HALF, 5.0, False)
    assert kind == "ACTIVE_REAR" and not M.is_at_fault(kind, True)
    # moving object overlapping the front edge -> ACTIVE_FRONT
    kind = M.collision_type(*ego, 3.0, np.array([4.5, 0.0]), 0.0, CAR_HALF, 2.0, False)
    assert kind == "ACTIVE_FRONT" and M.is_at_fault(kind, False)
    # moving object at the side (90°), not touching the front edge -> LATERAL: at fault only in a lane change
    kind = M.collision_type(*ego, 3.0, np.array([0.0, 2.2]), 0.0, CAR_HALF, 2.0, False)
    assert kind == "ACTIVE_LATERAL"
    assert not M.is_at_fault(kind, False) and M.is_at_fault(kind, True)


def test_collision_score():
    assert M.collision_score({}) == 1.0
    assert M.collision_score({"vehicle": 1}) == 0.0
    assert M.collision_score({"vru": 1}) == 0.0
    assert M.collision_score({"object": 1}) == 0.5  # 1 - 1/2
    assert M.collision_score({"object": 2}) == 0.0


def test_drivable_area_compliance():
    assert M.drivable_area_compliance(np.zeros((10, 4))) == 1.0
    assert M.drivable_area_compliance(np.full((10, 4), 0.29)) == 1.0
    c = np.zeros((10, 4))
    c[5, 2] = 0.3
    assert M.drivable_area_compliance(c) == 0.0


def test_driving_direction_compliance():
    dt = 0.1
    assert M.driving_direction_compliance(np.full(50, 0.5), dt) == 1.0
    # 10 steps of -0.19 m: worst 1 s sum = -1.9 m -> 1
    assert M.driving_direction_compliance(np.r_[np.ones(5), np.full(10, -0.19)], dt) == 1.0
    # -0.3 m per step for 1 s: -3 m -> 0.5
    assert M.driving_direction_compliance(np.r_[np.ones(5), np.full(20, -0.3)], dt) == 0.5
    # -0.7 m per step: -7 m in 1 s -> 0
    assert M.driving_direction_compliance(np.full(12, -0.7), dt) == 0.0


def test_progress_ratio_and_making_progress():
    assert M.progress_ratio(50.0, 100.0) == 0.5
    assert M.progress_ratio(1.0, 1.5) == 1.0  # both floored at 2 m
    assert M.progress_ratio(1.0, 20.0) == pytest.approx(0.1)  # max(1, 2) / 20
    assert M.progress_ratio(-3.0, 20.0) == 0.0
    assert M.progress_ratio(0.0, None) == 1.0
    assert M.making_progress(0.2) == 1.0 and M.making_progress(0.19) == 0.0


def test_time_to_collision():
    """The devkit's TTC check (torch, batched): ego centre at 0 heading +x at its speed, its rear axle 1.461 m
    behind; one car ahead or behind."""
    def ttc(ego_speed: float, obj_x: float, obj_speed: float) -> bool:
        return bool(ttc_violation(torch.zeros(1, 2), torch.zeros(1), torch.tensor([ego_speed]),
                                  torch.tensor(EGO_HALF[None], dtype=torch.float32), torch.tensor([[-1.461, 0.0]]),
                                  torch.zeros(1, dtype=torch.bool), torch.tensor([[[obj_x, 0.0]]]), torch.zeros(1, 1),
                                  torch.tensor([[obj_speed]]), torch.tensor(CAR_HALF[None, None], dtype=torch.float32),
                                  torch.ones(1, 1, dtype=torch.bool))[0])
    # gap between boxes: 10 - 2.588 - 2.4 = 5.012 m; closing at 10 m/s -> TTC 0.50 s <= 0.95 -> violation
    assert ttc(10.0, 10.0, 0.0)
    # closing at 4 m/s -> 1.25 s > 0.95 -> none
    assert not ttc(4.0, 10.0, 0.0)
    # ego stopped: TTC infinite
    assert not ttc(0.0, 5.5, 0.0)
    # the car is behind the ego (not within 30° ahead of the rear axle) -> ignored, even when faster
    assert not ttc(10.0, -10.0, 20.0)


def test_path_progress():
    path = np.array([[0.0, 0.0], [10.0, 0.0], [10.0, 10.0]])  # an L, 20 m long
    # along the first leg and round the corner: arc 2 -> 15
    assert M.path_progress(np.array([[2.0, 1.0], [9.0, -1.0], [11.0, 5.0]]), path) == pytest.approx(13.0)
    # driving backwards counts negative
    assert M.path_progress(np.array([[5.0, 0.0], [3.0, 0.5]]), path) == pytest.approx(-2.0)


def test_speed_limit_compliance():
    limit = np.full(11, 10.0)
    assert M.speed_limit_compliance(np.full(11, 9.0), limit, 0.1) == 1.0
    # 1 m/s over for all 11 samples: 1 - 11*0.1*1 / (2.23 * 1.0)
    assert M.speed_limit_compliance(np.full(11, 11.0), limit, 0.1) == pytest.approx(1 - 1.1 / 2.23)
    assert M.speed_limit_compliance(np.full(11, 20.0), limit, 0.1) == 0.0


def test_comfort():
    """From nuPlan's model state: rear-axle acceleration, yaw rate, yaw acceleration, heading (0.1 s apart)."""
    t = np.arange(151) * 0.1
    zero = np.zeros_like(t)
    gentle = np.where(t < 8.0, 1.0, 0.0)  # 1 m/s² for 8 s, then cruise: jerk of the step ~ 1 / 1.5 s < 4.13
    assert M.ego_is_comfortable(gentle, zero, zero, zero, 1.461, 0.1) == 1.0
    assert M.ego_is_comfortable(np.full_like(t, -6.0), zero, zero, zero, 1.461, 0.1) == 0.0  # -6 m/s² < -4.05
    # a steady turn at 0.5 rad/s: the devkit's centre acceleration is a + d·ω² = 1.461 · 0.25 (comfortable)
    assert M.ego_is_comfortable(zero, np.full_like(t, 0.5), zero, 0.5 * t, 1.461, 0.1) == 1.0
    assert M.ego_is_comfortable(zero, zero, zero, 1.2 * t, 1.461, 0.1) == 0.0  # heading turning at 1.2 > 0.95 rad/s


def test_scenario_score_and_aggregate():
    mult = {k: 1.0 for k in M.MULTIPLIERS}
    w = {"ego_progress": 0.5, "time_to_collision": 1.0, "speed_limit": 1.0, "comfort": 0.0}
    s = M.ScenarioScore("a", "t1", mult, w)
    assert s.score == pytest.approx((5 * 0.5 + 5 + 4 + 0) / 16)
    s0 = M.ScenarioScore("b", "t2", {**mult, "driving_direction_compliance": 0.5}, {k: 1.0 for k in M.WEIGHTS})
    assert s0.score == 0.5
    agg = M.aggregate([s, s0])
    assert agg["score"] == pytest.approx((s.score + 0.5) / 2)
    assert agg["type/t2"] == 0.5 and agg["num_scenarios"] == 2
    assert math.isnan(M.aggregate([])["score"])
