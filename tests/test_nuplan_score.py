"""nuPlan's closed-loop score reported by the nuPlan env per episode (synthetic dataset), and the log-following
expert."""
import dataclasses

import numpy as np
import pytest
import torch

from envs.metrics.nuplan import MULTIPLIERS, WEIGHTS, ego_is_comfortable
from envs.nuplan.cache import REAR_AXLE_TO_CENTRE
from envs.nuplan.env import build_nuplan_env, make_nuplan_env
from envs.sim.env import SimEnv
from envs.nuplan.scoring import ttc_violation
from envs.nuplan.expert import make_expert
from envs.nuplan.synthetic import make_synthetic_dataset

pytestmark = pytest.mark.nuplan


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = make_synthetic_dataset(tmp_path_factory.mktemp("nuplan"), num_logs=1)
    return root, tmp_path_factory.mktemp("cache")


def small(data, **kw) -> SimEnv:
    root, cache = data
    return make_nuplan_env(3, "cpu", 0, cache_dir=str(cache), data_root=str(root), route_split="eval",
                           sim={"bev_size": 32, "bev_ego_from_bottom": 12}, **kw)


def first_episodes(env: SimEnv, policy) -> dict[int, dict[str, float]]:
    obs = env.reset(seed=0)
    got: dict[int, dict[str, float]] = {}
    for _ in range(env.data.num_frames + 5):
        res = env.step(policy(obs))
        for row in torch.nonzero(res.terminated | res.truncated).flatten().tolist():
            got.setdefault(row, {k: float(v[row]) for k, v in res.info.items() if k.startswith("episode/")})
        obs = res.obs
        if len(got) == env.num_envs:
            break
    assert len(got) == env.num_envs
    return got


@pytest.mark.parametrize("reactive", [False, True])
def test_expert_replay_scores_high(data, reactive):
    env = small(data, reactive=reactive)
    eps = first_episodes(env, make_expert(env))
    for ep in eps.values():
        for k in (*MULTIPLIERS, *WEIGHTS):
            assert f"episode/nuplan/{k}" in ep
        assert ep["episode/nuplan/drivable_area_compliance"] == 1.0
        assert ep["episode/nuplan/driving_direction_compliance"] == 1.0
        assert ep["episode/nuplan/making_progress"] == 1.0
        assert ep["episode/nuplan/ego_progress"] > 0.9
    mean = sum(ep["episode/nuplan_score"] for ep in eps.values()) / len(eps)
    assert mean > (0.9 if not reactive else 0.6), eps
    # the expert is comfortable wherever the logged drive is (the log's yaw rate and its rate by finite differences)
    for ep in eps.values():
        log = env.data.scenarios[int(ep["episode/scenario"])].ego.astype(np.float64)
        yaw_rate = np.gradient(np.unwrap(log[:, 2]), 0.1)
        if ego_is_comfortable(log[:, 5], yaw_rate, np.gradient(yaw_rate, 0.1), log[:, 2], REAR_AXLE_TO_CENTRE, 0.1):
            assert ep["episode/nuplan/comfort"] == 1.0


def test_leaving_the_road_scores_zero(data):
    env = small(data)
    eps = first_episodes(env, lambda obs: torch.tensor([[1.0, 1.0]] * env.num_envs))
    for ep in eps.values():
        assert ep["episode/nuplan_score"] == 0.0
        assert ep["episode/nuplan/drivable_area_compliance"] == 0.0 or ep["episode/nuplan/no_at_fault_collisions"] < 1


def test_standing_still_fails_making_progress(data):
    env = small(data)
    eps = first_episodes(env, lambda obs: torch.tensor([[-1.0, 0.0]] * env.num_envs))
    for ep in eps.values():
        assert ep["episode/nuplan/making_progress"] == 0.0
        assert ep["episode/nuplan_score"] == 0.0


def test_at_fault_collision_scores_zero(data):
    """Put a stopped car right ahead of the driving ego: an ACTIVE_FRONT / STOPPED_TRACK collision is at fault (CaRL's
    training episodes end at it)."""
    env = small(data, run_to_end=False)
    env.reset(seed=0)
    s = env.state
    fwd = torch.stack((torch.cos(s.ego_yaw), torch.sin(s.ego_yaw)), -1)
    env.data.log_veh[s.scenario, 1, 0, :2] = s.ego_xy + fwd * 4.0
    env.data.log_veh[s.scenario, 1, 0, 2] = s.ego_yaw
    env.data.log_veh[s.scenario, 1, 0, 3:5] = torch.tensor([4.5, 2.0])
    env.data.log_veh[s.scenario, 1, 0, 5:7] = 0.0
    env.data.log_veh_valid[s.scenario, 1, 0] = True
    s.ego_speed[:] = 8.0
    res = env.step(torch.tensor([[1.0, 0.0]] * 3))
    assert res.terminated.all()
    assert (res.info["episode/nuplan/no_at_fault_collisions"] == 0).all()
    assert (res.info["episode/nuplan/time_to_collision"] == 0).all()
    assert (res.info["episode/nuplan_score"] == 0).all()


def test_ttc_step_check():
    ego = {"ego_xy": torch.zeros(2, 2), "ego_yaw": torch.zeros(2), "ego_speed": torch.tensor([10.0, 0.0]),
           "ego_half": torch.tensor([[2.5, 1.0]] * 2), "rear_xy": torch.tensor([[-1.5, 0.0]] * 2),
           "wide": torch.zeros(2, dtype=torch.bool)}
    box = {"yaw": torch.zeros(2, 2), "half": torch.tensor([2.5, 1.0]).expand(2, 2, 2),
           "valid": torch.ones(2, 2, dtype=torch.bool)}
    # a stopped car 10 m ahead: gap 5 m, closed at 10 m/s in 0.5 s <= 0.95 s; the stopped ego has no TTC
    out = ttc_violation(**ego, xy=torch.tensor([[[10.0, 0.0], [-10.0, 0.0]]] * 2), speed=torch.zeros(2, 2), **box)
    assert out.tolist() == [True, False]
    # 30 m ahead: gap 25 m is 2.5 s away; a faster car behind is never relevant ahead of a lane-keeping ego
    out = ttc_violation(**ego, xy=torch.tensor([[[30.0, 0.0], [-6.0, 0.0]]] * 2),
                        speed=torch.tensor([[0.0, 20.0]] * 2), **box)
    assert out.tolist() == [False, False]
    # a car beside the ego at 45° of its rear axle, converging: relevant only when the ego is not in a common lane
    # (or in an intersection): 6 m left of the centre, driving right across the ego's path at 10 m/s
    side = {"xy": torch.tensor([[[3.0, 6.0], [100.0, 100.0]]] * 2), "speed": torch.tensor([[10.0, 0.0]] * 2),
            "yaw": torch.tensor([[-1.5707963, 0.0]] * 2), "half": box["half"], "valid": box["valid"]}
    assert ttc_violation(**ego, **side).tolist() == [False, False]
    ego["wide"] = torch.ones(2, dtype=torch.bool)
    assert ttc_violation(**ego, **side).tolist() == [True, False]
    # tracks already collided with are not valid any more
    side["valid"] = torch.zeros(2, 2, dtype=torch.bool)
    assert ttc_violation(**ego, **side).tolist() == [False, False]


def test_each_scenario_runs_to_its_own_end_and_scores_the_same_in_any_batch(data):
    """The devkit simulates every scenario to its last frame; a scenario's score must not depend on its batch mates
    (rows of one env hold different scenarios; each alone in an env of one row)."""
    base = small(data)
    # scenarios of different lengths: cut the logs of two of them short
    scenarios = [dataclasses.replace(sc, ego=sc.ego[:n], agents=sc.agents[:n], agent_valid=sc.agent_valid[:n],
                                     lights=sc.lights[:n]) for sc, n in zip(base.data.scenarios, (151, 120, 97))]
    opts = dataclasses.replace(base.data.opts, sim={"bev_size": 32, "bev_ego_from_bottom": 12})
    env = build_nuplan_env(scenarios, opts, 3)
    together = first_episodes(env, make_expert(env))
    assert sorted(ep["episode/length"] for ep in together.values()) == [96, 119, 150]
    for row, ep in together.items():
        sc = env.data.scenarios[int(ep["episode/scenario"])]
        assert ep["episode/length"] == sc.num_frames - 1
        assert ep["episode/termination/scenario_end"] == 1.0 and ep["episode/termination/timeout"] == 0.0
        alone_env = build_nuplan_env([sc], opts, 1)
        alone = first_episodes(alone_env, make_expert(alone_env))[0]
        for k in ("episode/nuplan_score", *(f"episode/nuplan/{m}" for m in (*MULTIPLIERS, *WEIGHTS))):
            assert alone[k] == pytest.approx(ep[k], abs=1e-6), (sc.token, k)
