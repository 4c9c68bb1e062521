"""Gymnasium front-ends: the environment checker, and make_vec over the batched simulator."""
from __future__ import annotations

import gymnasium
import numpy as np
from gymnasium.utils.env_checker import check_env

import envs.gym  # noqa: F401  (registers carl/Sim-v0)

OPTIONS = dict(town_seeds=(0,), num_routes=16, route_length=(80.0, 120.0), bev_size=32, bev_ego_from_bottom=12)


def test_single_env_passes_gymnasium_checker():
    env = gymnasium.make("carl/Sim-v0", **OPTIONS)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=1)
    assert obs["bev"].shape == (10, 32, 32) and obs["bev"].dtype == np.uint8
    obs, reward, term, trunc, info = env.step(np.array([0.0, 0.5], np.float32))
    assert env.observation_space.contains(obs) and isinstance(reward, float)


def test_episode_end_returns_terminal_observation_and_stats():
    env = gymnasium.make("carl/Sim-v0", **OPTIONS, blocked_time=0.3, traffic=False)
    env.reset(seed=0)
    for _ in range(10):
        obs, reward, term, trunc, info = env.step(np.array([0.0, -1.0], np.float32))
        if term or trunc:
            break
    assert term and info["episode/termination/blocked"] == 1.0
    assert obs["value_measurements"][0] < 1.0  # the terminal observation, not the next episode's first


def test_make_vec_uses_the_batched_simulator():
    venv = gymnasium.make_vec("carl/Sim-v0", num_envs=4, vectorization_mode="vector_entry_point", **OPTIONS)
    obs, _ = venv.reset(seed=0)
    assert obs["bev"].shape == (4, 10, 32, 32)
    obs, reward, term, trunc, info = venv.step(np.zeros((4, 2), np.float32))
    assert reward.shape == (4,) and term.dtype == bool
    assert venv.single_action_space.shape == (2,)


def test_the_vector_observation_is_a_dict_space_that_passes_the_checker():
    env = gymnasium.make("carl/Sim-v0", **{**OPTIONS, "observation": "vector", "bev": False})
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=1)
    assert "bev" not in obs and obs["lanes"].shape == (32, 9) and obs["route"].shape == (20, 8)
    obs, *_ = env.step(np.array([0.0, 0.5], np.float32))
    assert env.observation_space.contains(obs)
