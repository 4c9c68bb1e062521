"""The built-in simulator: determinism, infractions, the expert, episode statistics and bad input."""
from __future__ import annotations

import pytest
import torch

from envs import make_env
from envs.maps.lanegraph import MapError
from envs.config import ConfigError
from envs.sim.config import SimConfig
from envs.sim.env import SimEnv
from envs.sim.expert import Expert

SMALL = dict(town_seeds=(0,), num_routes=32, route_length=(120.0, 200.0), bev_size=64, bev_ego_from_bottom=24)


def small_env(num_envs: int = 8, seed: int = 0, **kw) -> SimEnv:
    return make_env("sim", num_envs, "cpu", seed, **{**SMALL, **kw})


def run_episodes(env: SimEnv, policy, max_steps: int = 2000) -> list[dict[str, float]]:
    """First finished episode of every row."""
    obs = env.reset()
    got: dict[int, dict[str, float]] = {}
    for _ in range(max_steps):
        r = env.step(policy(obs))
        obs = r.obs
        for b in torch.nonzero(r.info["done"]).flatten().tolist():
            got.setdefault(b, {k[8:]: float(v[b]) for k, v in r.info.items() if k.startswith("episode/")})
        if len(got) == env.num_envs:
            break
    return list(got.values())


def test_observation_spec_and_shapes():
    env = small_env(4)
    obs = env.reset()
    for key, spec in env.observation_spec.items():
        assert obs[key].shape == (4, *spec.shape) and obs[key].dtype == spec.dtype
    # the ego stands on a road: the road channel is set under the ego pixel
    row = 64 - 1 - 24
    assert (obs["bev"][:, 0, row, 32] > 0).all()


def test_same_seed_same_rollout():
    def rollout(seed):
        env = small_env(6, seed=seed)
        env.reset()
        gen = torch.Generator().manual_seed(1)
        rewards, bevs = [], []
        for _ in range(40):
            r = env.step(torch.rand(6, 2, generator=gen) * 2 - 1)
            rewards.append(r.reward)
            bevs.append(r.obs["bev"].float().sum())
        return torch.stack(rewards), torch.stack(bevs), r.obs["measurements"]

    a, b, c = rollout(3), rollout(3), rollout(4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_expert_completes_routes_without_traffic():
    env = small_env(12, traffic=False, bev=False, route_split="eval")
    episodes = run_episodes(env, Expert(env))
    assert len(episodes) == 12
    completed = [e for e in episodes if e["termination/route_completed"] == 1]
    assert len(completed) / len(episodes) >= 0.95
    for e in completed:
        assert e["route_completion"] > 97
        hard = ("collision_vehicle", "collision_pedestrian", "collision_static", "red_light", "stop_sign", "off_road")
        assert all(e[f"infractions/{k}"] == 0 for k in hard)
        assert e["driving_score"] == pytest.approx(e["route_completion"] * e["infraction_score"], rel=1e-5)


def test_running_lights_at_full_throttle_is_caught():
    """Expert steering with the throttle floored runs red lights or stop signs sooner or later."""
    env = small_env(16, traffic=False, bev=False, town_seeds=(0, 1), num_routes=64, route_length=(300.0, 400.0))
    expert = Expert(env)

    def reckless(obs):
        a = expert(obs)
        a[:, 1] = 0.6
        return a

    episodes = run_episodes(env, reckless)
    runs = sum(e["termination/red_light"] + e["termination/stop_sign"] for e in episodes)
    assert runs >= 1
    red = [e for e in episodes if e["termination/red_light"] == 1]
    for e in red:  # the terminal penalty of 1 is part of the return
        assert e["return"] < e["route_completion"]


def test_leaving_the_road_ends_the_episode():
    env = small_env(2, traffic=False, bev=False)
    env.reset()
    side = torch.stack((-torch.sin(env.state.ego_yaw), torch.cos(env.state.ego_yaw)), -1)
    env.state.ego_xy = env.state.ego_xy + side * torch.tensor([[12.0], [40.0]])  # beside the road / far away
    r = env.step(torch.zeros(2, 2))
    assert r.terminated.all()
    assert r.info["episode/termination/off_road"].tolist() == [1.0, 1.0]
    assert r.info["episode/infractions/route_deviation"].tolist() == [0.0, 1.0]


def test_standing_still_is_blocked():
    env = small_env(2, traffic=False, bev=False, blocked_time=2.0)
    episodes = run_episodes(env, lambda obs: torch.tensor([[0.0, -1.0]] * 2), max_steps=100)
    assert [e["termination/blocked"] for e in episodes] == [1.0, 1.0]
    assert all(e["length"] == pytest.approx(21, abs=1) for e in episodes)


def test_vehicle_collision_terminates_with_penalty():
    env = small_env(2, traffic=True, bev=False, num_vehicles=2)
    env.reset()
    s = env.state
    # put vehicle 0 right in front of the ego, overlapping it
    s.veh.valid[:, 0] = True
    s.veh.speed[:, 0] = 0.0
    fwd = torch.stack((torch.cos(s.ego_yaw), torch.sin(s.ego_yaw)), -1)
    from envs.sim import agents
    target = s.ego_xy + fwd * 3.0
    lane, lateral, _, _, _ = __import__("envs.sim.world", fromlist=["lane_lookup"]).lane_lookup(env.world, target)
    d = (env.world.lane_pts[lane] - target.unsqueeze(1)).norm(dim=-1)
    s.veh.lane[:, 0] = lane
    s.veh.s[:, 0] = d.argmin(-1).float() * env.world.lane_spacing[lane]
    s.veh.xy, s.veh.yaw = agents.lane_pose(env.world, s.veh.lane, s.veh.s)
    r = env.step(torch.tensor([[0.0, 1.0]] * 2))
    assert r.terminated.all()
    assert (r.info["episode/termination/collision_vehicle"] == 1).all()
    assert (r.reward <= -0.9).all()
    assert r.info["episode/infraction_score"] == pytest.approx(torch.full((2,), 0.6))


def test_auto_reset_starts_a_new_episode():
    env = small_env(2, traffic=False, bev=False, blocked_time=0.5)
    env.reset()
    for _ in range(6):
        r = env.step(torch.tensor([[0.0, -1.0]] * 2))
    assert r.info["done"].all()
    assert (env.state.t == 0).all() and (env.state.steps == 0).all()
    assert (r.obs["value_measurements"][:, 0] == 1.0).all()


def test_bad_actions_and_config():
    env = small_env(2, bev=False)
    env.reset()
    with pytest.raises(ValueError, match="NaN"):
        env.step(torch.tensor([[0.0, float("nan")], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="shape"):
        env.step(torch.zeros(3, 2))
    r = env.step(torch.tensor([[5.0, -7.0], [0.0, 0.0]]))  # out of range is clipped (documented)
    assert r.obs["measurements"][0, 0] == 1.0 and r.obs["measurements"][0, 2] == 1.0
    with pytest.raises(ConfigError, match="route_split"):
        SimConfig(route_split="test").validate()
    with pytest.raises(ConfigError, match="eval_town_seeds"):
        SimConfig(town_seeds=(1,), eval_town_seeds=(1,)).validate()
    with pytest.raises(MapError, match="Town99"):
        make_env("sim", 1, map="Town99")
    with pytest.raises(ValueError, match="unknown environment backend"):
        make_env("gta", 1)


def test_random_routes_change_lanes_only_when_asked() -> None:
    """env.options.route_lane_changes: consecutive route points on same-direction neighbour lanes (the graph's
    left/right) appear on the random routes with the option and never without it (each option its own world)."""
    from envs import make_env

    def routes_changing_lanes(on: bool) -> int:
        w = make_env("sim", 2, "cpu", 0, bev=False, num_routes=32, route_lane_changes=on).world
        lanes, n, g = w.route_lane.numpy(), w.route_n.numpy(), w.graph
        return sum(int(((g.left[lanes[k, :n[k] - 1]] == lanes[k, 1:n[k]])
                        | (g.right[lanes[k, :n[k] - 1]] == lanes[k, 1:n[k]])).any()) for k in range(len(n)))

    assert routes_changing_lanes(False) == 0
    assert routes_changing_lanes(True) >= 8
