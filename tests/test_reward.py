"""CaRL's reward, hand-computed cases, and the Leaderboard infraction score."""
from __future__ import annotations

import pytest
import torch

from envs.reward import COMFORT_METRICS, RewardConfig, RewardInputs, RewardState, comfort_violations, compute_reward
from envs.sim.infractions import INFRACTIONS, infraction_score, savgol_kernel


def inputs(**kw) -> RewardInputs:
    base = dict(progress=torch.tensor([0.5]), outside_lanes=torch.tensor([False]), speed=torch.tensor([5.0]),
                speed_limit=torch.tensor([10.0]), ttc_violation=torch.tensor([False]),
                comfort_violation=torch.zeros(1, 6, dtype=torch.bool), lane_offset_ratio=torch.tensor([0.0]),
                terminal_penalty=torch.tensor([False]))
    base.update(kw)
    return RewardInputs(**base)


def reward(cfg=RewardConfig(), state=None, **kw) -> float:
    state = state or RewardState.zeros(1, torch.device("cpu"))
    return float(compute_reward(inputs(**kw), state, cfg).reward[0])


def test_plain_progress_is_the_reward():
    assert reward() == pytest.approx(0.5)


def test_outside_lanes_zeroes_progress_but_not_the_penalty():
    assert reward(outside_lanes=torch.tensor([True])) == 0.0
    assert reward(outside_lanes=torch.tensor([True]), terminal_penalty=torch.tensor([True])) == -1.0


def test_speeding_factor():
    # 1.115 m/s over the limit: half of CaRL's 2.23 m/s margin
    assert reward(speed=torch.tensor([11.115])) == pytest.approx(0.25)
    assert reward(speed=torch.tensor([20.0])) == 0.0


def test_lane_centre_factor():
    assert reward(lane_offset_ratio=torch.tensor([0.4])) == pytest.approx(0.3)


def test_ttc_window_lasts_its_ticks():
    cfg = RewardConfig(ttc_penalty_ticks=3)
    st = RewardState.zeros(1, torch.device("cpu"))
    got = [reward(cfg, st, ttc_violation=torch.tensor([i == 0])) for i in range(5)]
    assert got == pytest.approx([0.25, 0.25, 0.25, 0.5, 0.5])


def test_comfort_factor_counts_active_windows():
    st = RewardState.zeros(1, torch.device("cpu"))
    viol = torch.zeros(1, 6, dtype=torch.bool)
    viol[0, :3] = True
    assert reward(state=st, comfort_violation=viol) == pytest.approx(0.5 * (1 - 0.5 * 3 / 6))


def test_factors_multiply_and_penalty_subtracts():
    r = reward(speed=torch.tensor([11.115]), lane_offset_ratio=torch.tensor([0.5]), terminal_penalty=torch.tensor([True]))
    assert r == pytest.approx(0.5 * 0.5 * 0.5 - 1.0)


def test_comfort_limits():
    z = torch.zeros(1)
    v = comfort_violations(torch.tensor([-25.0]), z, z, z, torch.tensor([1.5]), z, RewardConfig())
    assert v[0].tolist() == [True, False, False, False, True, False] and len(COMFORT_METRICS) == 6


def test_savgol_derivative_of_a_ramp_is_its_slope():
    k = torch.as_tensor(savgol_kernel(8, 2, 1, 0.1))
    speed = torch.arange(8, dtype=torch.float32) * 0.3  # +3 m/s^2 at 10 Hz
    assert float((k * speed).sum()) == pytest.approx(3.0, rel=1e-4)


def test_leaderboard_infraction_score():
    counts = torch.zeros(1, len(INFRACTIONS), dtype=torch.long)
    counts[0, INFRACTIONS.index("collision_vehicle")] = 1
    counts[0, INFRACTIONS.index("red_light")] = 2
    score = infraction_score(counts, torch.tensor([10.0]))
    assert float(score) == pytest.approx(0.6 * 0.7 * 0.7 * 0.9)


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match="reward.ttc_factor"):
        RewardConfig(ttc_factor=2.0).validate()


def test_carla_is_the_default_mode_and_ignores_the_nuplan_constants():
    from envs.reward import NuplanRewardConfig

    assert RewardConfig().mode == "carl_carla"
    g = torch.Generator().manual_seed(0)
    B = 64
    inp = RewardInputs(progress=torch.rand(B, generator=g), outside_lanes=torch.rand(B, generator=g) < 0.2,
                       speed=torch.rand(B, generator=g) * 15, speed_limit=torch.full((B,), 10.0),
                       ttc_violation=torch.rand(B, generator=g) < 0.3,
                       comfort_violation=torch.rand(B, 6, generator=g) < 0.2,
                       lane_offset_ratio=torch.rand(B, generator=g), terminal_penalty=torch.rand(B, generator=g) < 0.1)
    other = RewardConfig(nuplan=NuplanRewardConfig(accumulation="nuplan", reward_factor=5.0))
    a = compute_reward(inp, RewardState.zeros(B, torch.device("cpu")), RewardConfig())
    b = compute_reward(inp, RewardState.zeros(B, torch.device("cpu")), other)
    assert torch.equal(a.reward, b.reward) and a.terminated is None
