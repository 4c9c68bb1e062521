"""The expert against the route scenarios (envs/sim/expert.py): its launch forecast checked against the ego model,
what it knows of a flow's unseen next cars checked against the flow's rule, and the right-turn merge driven end to
end on the hand-built 4-way junction of tests/test_scenarios.py."""
from __future__ import annotations

import pytest
import torch

import envs
from envs.sim.dynamics import DRAG, ROLLING, Car, bicycle_step
from envs.sim.expert import FORECAST, LAUNCH_SPEED, Expert, _full_throttle
from envs.sim.scenarios import DONE
from tests.test_scenarios import HALF, OFF, env_with, place_in_trigger_circle


def test_the_launch_forecast_is_where_the_ego_model_gets_at_full_throttle() -> None:
    """Integrate the bicycle model at 10 ms with throttle 1 (then the throttle that holds LAUNCH_SPEED) from 0, 5
    and 12 m/s; the closed form must land within 0.15 m at every forecast time."""
    car = Car()
    v0 = torch.tensor([0.0, 5.0, 12.0])
    xy, yaw, v = torch.zeros(3, 2), torch.zeros(3), v0.clone()
    dt, expected = 0.01, []
    for k in range(int(round(float(FORECAST[-1]) / dt)) + 1):
        if k % 25 == 0:  # FORECAST is every 0.25 s
            expected.append(xy[:, 0].clone())
        hold = v >= LAUNCH_SPEED
        throttle = torch.where(hold, (DRAG * v * v + ROLLING) / car.max_accel, torch.ones_like(v))
        xy, yaw, v, _ = bicycle_step(torch, car, xy, yaw, v, torch.zeros(3), throttle, torch.zeros(3), dt)
        v = torch.where(hold, torch.full_like(v, LAUNCH_SPEED), v)
    got = _full_throttle(v0.unsqueeze(1), car.max_accel - ROLLING, FORECAST)
    assert torch.allclose(got, torch.stack(expected, 1), atol=0.15)


def test_the_flows_next_two_cars_are_expected_where_the_flows_rule_spawns_them() -> None:
    """Right-turn flow from the north arm: source 100 m up the southbound lane (x = -1.75, y = 8 + 100), heading
    south at 20 m/s. The next car spawns once the last one is the drawn gap (``next_gap``) from the source, so it is
    expected that gap behind the last (at the source if the last one is already further); the one after at the
    minimum gap, 25 m, further back."""
    env = env_with("SignalizedJunctionRightTurn", to="S")
    place_in_trigger_circle(env)
    env.step(torch.tensor([[0.0, -1.0]]))
    for _ in range(3):
        s = env.state
        xy, yaw, speed, valid = env.scenarios.next_flow_cars(s)
        flow = 0  # the flows' slot group
        alive = s.scn.act_alive[0, flow]
        last = float(s.scn.act_s[0, flow][alive].min())  # m from the source
        drawn = float(s.scn.next_gap[0, flow])
        assert 25.0 <= drawn <= 50.0
        behind = max(drawn - last, 0.0)
        assert bool(valid[0, flow].all())
        assert torch.allclose(xy[0, flow], torch.tensor([[-OFF, HALF + 100.0 + behind],
                                                         [-OFF, HALF + 100.0 + behind + 25.0]]), atol=0.05)
        assert torch.allclose(yaw[0, flow], torch.full((2,), -torch.pi / 2), atol=1e-3)
        assert speed[0, flow].tolist() == [20.0, 20.0]
        for _ in range(7):
            env.step(torch.tensor([[0.0, -1.0]]))


def test_the_expert_merges_into_the_right_turn_stream_without_a_timeout_or_collision() -> None:
    """Four rows, four draws of the stream's gaps: the expert turns right into the 20 m/s stream (which ignores it)
    and each scenario ends passed, well inside its 240 s timeout."""
    env = env_with("SignalizedJunctionRightTurn", to="S", num_envs=4)
    expert = Expert(env)
    obs = env.reset()
    for _ in range(1200):  # 120 s
        obs = env.step(expert(obs)).obs
        if bool((env.state.scn.status[:, 0] == DONE).all()):
            break
    c = env.state.scn
    assert bool((c.status[:, 0] == DONE).all()), c.status[:, 0]
    assert not bool(c.timed_out[:, 0].any()) and not bool(c.collided[:, 0].any())


def test_the_seen_only_expert_knows_no_unspawned_car_and_only_the_sim_has_it() -> None:
    """In a live right-turn flow the full expert's knowledge holds the flow's next two cars (valid, as the test above
    places them); the seen-only variant (``ppo.teacher=expert_seen``) holds the same slots, all invalid, and the
    same scripted-path forecast of the cars that exist. CARLA's and nuPlan's experts have no such variant."""
    env = env_with("SignalizedJunctionRightTurn", to="S")
    place_in_trigger_circle(env)
    for _ in range(3):
        env.step(torch.tensor([[0.0, -1.0]]))
    s = env.state
    full, seen = envs.make_expert("sim", env), envs.make_expert("sim", env, seen_only=True)
    *_, valid, forecast = full.scenario_knowledge(s)
    *_, seen_valid, seen_forecast = seen.scenario_knowledge(s)
    assert int(valid.sum()) == 2 and seen_valid.shape == valid.shape and not bool(seen_valid.any())
    assert all(torch.equal(a, b) for a, b in zip(forecast, seen_forecast))
    for backend in ("carla", "nuplan"):
        with pytest.raises(ValueError, match=f"env '{backend}': its expert has no seen-only variant"):
            envs.make_expert(backend, None, seen_only=True)
