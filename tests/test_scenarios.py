"""Route scenarios in the simulator (envs/sim/scenarios.py), one test per behaviour, with expectations computed here
from the Leaderboard's rules (../shared/docs/scenarios.md §3) on a hand-built map: a 4-way junction at the origin
with 120 m arms, one 3.5 m lane per direction (right-hand traffic), lights on every approach (E-W phase 0, N-S
phase 1). The ego drives from the west end eastwards."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from envs.config import ConfigError
from envs.maps.lanegraph import CONTROL_LIGHT, CONTROL_STOP, Lane, LaneGraph, LightGroup, StopLine
from envs.maps.routes import plan_route
from envs.maps.scenarios import ScenarioDef, scenarios_on_route
from envs.sim.agents import LIGHT_EMERGENCY
from envs.sim.config import SimConfig
from envs.sim.env import SimEnv
from envs.sim.infractions import INFRACTIONS
from envs.sim.scenarios import DONE, LIVE
from envs.sim.world import build_world

HALF, ARM, OFF, WIDTH = 8.0, 120.0, 1.75, 3.5
DIRS = {"E": (1.0, 0.0), "N": (0.0, 1.0), "W": (-1.0, 0.0), "S": (0.0, -1.0)}
PHASE = {"E": 0, "W": 0, "N": 1, "S": 1}


def _bezier(p0: np.ndarray, u0: np.ndarray, p2: np.ndarray, u2: np.ndarray) -> np.ndarray:
    m = np.stack([u0, u2], axis=1)
    c = 0.5 * (p0 + p2) if abs(np.linalg.det(m)) < 1e-9 else p0 + np.linalg.solve(m, p2 - p0)[0] * u0
    t = np.linspace(0.0, 1.0, 25)[:, None]
    return (1 - t) ** 2 * p0 + 2 * (1 - t) * t * c + t ** 2 * p2


def junction_map(arms: str = "ENWS", lit: bool = True) -> LaneGraph:
    """A lit junction of the ``arms`` (a 4-way one by default; "EWS": a T without the north arm); ``lit=False``: stop
    signs on every approach instead of lights."""
    dirs = {k: d for k, d in DIRS.items() if k in arms}
    lanes, ids, stops = [], {}, []
    for k, d in dirs.items():
        d = np.array(d)
        r = np.array([d[1], -d[0]])
        ids[f"out_{k}"] = len(lanes)
        lanes.append(Lane(points=np.stack([d * HALF + r * OFF, d * (HALF + ARM) + r * OFF]), width=WIDTH))
        ids[f"in_{k}"] = len(lanes)
        lanes.append(Lane(points=np.stack([d * (HALF + ARM) - r * OFF, d * HALF - r * OFF]), width=WIDTH))
        stops.append(StopLine(lane=ids[f"in_{k}"], control=CONTROL_LIGHT, light_group=len(stops)) if lit
                     else StopLine(lane=ids[f"in_{k}"], control=CONTROL_STOP))
    for a, da in dirs.items():
        for b, db in dirs.items():
            if a != b:
                da_, db_ = np.array(da), np.array(db)
                ra, rb = np.array([da_[1], -da_[0]]), np.array([db_[1], -db_[0]])
                pts = _bezier(da_ * HALF - ra * OFF, -da_, db_ * HALF + rb * OFF, db_)
                lanes[ids[f"in_{a}"]].successors.append(len(lanes))
                lanes.append(Lane(points=pts, is_junction=True, junction=0, successors=[ids[f"out_{b}"]], width=WIDTH))
    groups = [LightGroup(junction=0, phase=PHASE[k], num_phases=2) for k in dirs] if lit else []
    return LaneGraph.build("junction", lanes, stops, groups)


def env_with(kind: str, to: str = "E", num_envs: int = 1, dt: float = 0.1, rules: str = "leaderboard",
             **params: str) -> SimEnv:
    """An env whose one route (west end -> ``to``) carries one scenario of ``kind`` triggered 30 m before the
    junction box (at x = -38); Leaderboard rules unless ``rules`` says otherwise."""
    graph = junction_map()
    end = {"E": (HALF + ARM - 5, -OFF), "N": (OFF, HALF + ARM - 5), "S": (-OFF, -HALF - ARM + 5)}[to]
    route = plan_route(graph, np.array([[-HALF - ARM + 5, -OFF], end]), name="r")
    sd = ScenarioDef(kind, kind, (-38.0, -OFF), 0.0, {k: {"value": v} for k, v in params.items()})
    route.scenarios = tuple(scenarios_on_route([sd], route.points, "r"))
    cfg = SimConfig(traffic=False, rules=rules, bev=False, dt=dt).validate()
    world = build_world(graph, [route], cfg, torch.device("cpu"))
    assert world.route_scenarios[0][0].kept, world.route_scenarios[0][0].reason
    env = SimEnv(cfg, num_envs, world=world)
    env.reset()
    return env


def place_in_trigger_circle(env: SimEnv, speed: float = 0.0) -> None:
    """Put the ego (standing) at the trigger circle's first route point, its route trackers with it."""
    s, first = env.state, int(env.world.scn.act_first[0])
    s.ego_xy[0] = env.world.route_pts[0, first]
    s.route_idx[0] = s.crit.dev_idx[0] = first
    s.ego_speed[0] = speed


def drive(env: SimEnv, speed: float, steps: int, brake_at_x: float | None = None, record=None) -> dict:  # noqa: ANN001
    """Hold ``speed`` (set on the state: a policy with perfect speed control), steering by pure pursuit; brake to a
    stop once the ego passes ``brake_at_x``. Returns the last step's info."""
    from envs.sim.expert import Expert

    steer = Expert(env).steer
    info = {}
    for _ in range(steps):
        s = env.state
        stop = brake_at_x is not None and bool(s.ego_xy[0, 0] > brake_at_x)
        if not stop:
            s.ego_speed = torch.full_like(s.ego_speed, speed)
        lon = torch.full((env.num_envs,), -1.0 if stop else 0.0)
        res = env.step(torch.stack((steer(s), lon), -1))
        info = res.info
        if record is not None:
            record(env.state, res.info)
    return info


def test_a_scenario_activates_once_in_its_trigger_circle() -> None:
    """Trigger (-38, -1.75) on a route of 1 m points along y = -1.75: the first point closer than 2 m lies at
    x = -39.x (2 m before), so the scenario goes live at the first step whose route index reaches it, and never again."""
    env = env_with("ControlLoss")
    w, s = env.world, env.state
    first = int(w.scn.act_first[0])
    assert float(w.route_pts[0, first, 0]) == pytest.approx(-38.0 - 2.0, abs=1.0)
    assert (w.route_pts[0, first] - torch.tensor([-38.0, -OFF])).norm() < 2.0
    assert (w.route_pts[0, first - 1] - torch.tensor([-38.0, -OFF])).norm() >= 2.0
    seen = []
    drive(env, 8.0, 270, record=lambda s, info: seen.append((int(s.route_idx[0]), int(s.scn.status[0, 0]))))
    live_from = next(k for k, (_, st) in enumerate(seen) if st >= LIVE)
    assert seen[live_from - 1][0] < first <= seen[live_from][0]
    # ends 110 m after activation, and never fires again (done until the episode ends)
    statuses = [st for _, st in seen[live_from:]]
    assert DONE in statuses and statuses[statuses.index(DONE):] == [DONE] * (len(statuses) - statuses.index(DONE))
    assert float(env.state.scn.act_m[0, 0]) == pytest.approx(float(w.route_cum[0, seen[live_from][0]]))


def test_the_pedestrian_waits_for_the_start_rule_and_walks_at_2_m_s() -> None:
    """C = trigger + 12 m = (-26, -1.75); the pedestrian stands 1 m further on, on the sidewalk: 1.75 m (half the
    lane) + 1 m beyond the kerb, i.e. at (-25, -4.5), facing +y. It starts when the ego is < 2.1 s or < 6 m from
    C, then moves 0.2 m per 0.1 s step."""
    env = env_with("DynamicObjectCrossing")
    ped0 = env.scenarios.ped0
    track = []
    drive(env, 4.0, 280, record=lambda s, info: track.append((
        s.ego_xy[0].clone(), bool(s.scn.status[0, 0] >= LIVE), bool(s.ped.valid[0, ped0]), s.ped.xy[0, ped0].clone(),
        float(s.ego_speed[0]))))
    shown = [k for k, (_, live, valid, _, _) in enumerate(track) if valid]
    assert shown and all(track[k][1] for k in shown)  # visible only once live
    assert track[shown[0]][3].tolist() == pytest.approx([-25.0, -4.5], abs=1e-4)
    c = torch.tensor([-26.0, -OFF])
    moved = [k for k in shown if track[k][3][1] > -4.5 + 1e-4]
    k0 = moved[0]
    # the start rule holds at the step it moves first (it moves in the step it starts), not at the one before
    d, v = float((track[k0][0] - c).norm()), track[k0][4]
    assert d / v < 2.1 or d < 6.0
    d, v = float((track[k0 - 1][0] - c).norm()), track[k0 - 1][4]
    assert not (d / v < 2.1 or d < 6.0)
    assert float(track[k0 + 5][3][1] - track[k0][3][1]) == pytest.approx(5 * 0.2, abs=1e-4)
    assert float(track[k0 + 5][3][0]) == pytest.approx(-25.0, abs=1e-4)


def test_driving_on_at_constant_speed_hits_the_pedestrian_and_stopping_does_not() -> None:
    """At 8 m/s the ego enters the trigger circle ~13.5 m before C (x = -39.5), within 2.1 s x 8 m/s = 16.8 m, so
    the pedestrian starts at once. Its box reaches the ego's lane half (y > -2.8) after (4.5 - 0.3 - 2.8) / 2 = 0.7 s
    and leaves it (y > -0.7) after (4.5 + 0.3 - 0.7) / 2 = 2.05 s; the ego's front reaches x = -25.3 after
    (-25.3 + 39.5 - 2.45) / 8 = 1.47 s and its back passes x = -24.7 after (-24.7 + 39.5 + 2.45) / 8 = 2.16 s: they
    meet. Braking at full 8 m/s² from x = -40 stops it within 4 m, 11 m before the pedestrian's line."""
    on = drive(env_with("DynamicObjectCrossing"), 8.0, 140)
    assert on["episode/infractions/collision_pedestrian"][0] == 1
    assert on["episode/scenarios/DynamicObjectCrossing/collided"][0] == 1
    stop = drive(env_with("DynamicObjectCrossing"), 8.0, 140, brake_at_x=-40.0)
    assert stop["episode/infractions/collision_pedestrian"][0] == 0
    assert stop["episode/scenarios/DynamicObjectCrossing/triggered"][0] == 1


def test_a_hit_pedestrian_ends_its_crossing_and_the_scenario_ends_40_m_later() -> None:
    """The collision of the test above: the rules remove the hit pedestrian, so its crossing ends there (the
    Leaderboard destroys walker and blocker when the walk ends, and ends the scenario 40 m on): from the next step the
    blocker is gone and the finish is the ego's route metres then; the scenario ends once the ego has driven 40 m
    more. (It once stayed live, its blocker shown, until the episode ended.)"""
    env = env_with("DynamicObjectCrossing")
    w, sta0, log = env.world, env.scenarios.sta0, []

    def record(s, info) -> None:  # noqa: ANN001
        log.append((float(info["episode/infractions/collision_pedestrian"][0]), bool(s.statics.valid[0, sta0]),
                    float(w.route_cum[0, s.route_idx[0]]), float(s.scn.fin_m[0, 0]), int(s.scn.status[0, 0])))

    drive(env, 8.0, 220, record=record)  # 0.8 m per step: the hit near x = -27, the end 40 m past it by step ~170
    hit = next(k for k, x in enumerate(log) if x[0] == 1)
    assert log[hit][1] and math.isinf(log[hit][3])  # the blocker still there in the step of the hit
    assert not log[hit + 1][1] and log[hit + 1][3] == log[hit + 1][2]  # the next step: gone, finished there
    end = next(k for k, x in enumerate(log) if x[4] == DONE)
    assert log[end][2] >= log[hit + 1][2] + 40.0 > log[end - 1][2]
    assert not any(x[1] for x in log[hit + 1:])  # the blocker never comes back


def test_a_collision_that_ends_the_episode_counts_against_the_live_scenario() -> None:
    """Under CaRL's training rules the pedestrian collision of the test above ends the episode in the step it happens;
    the episode's statistics still charge it to the live scenario (training logs once counted 0 such collisions)."""
    ended = []
    drive(env_with("DynamicObjectCrossing", rules="carl"), 8.0, 140,
          record=lambda s, info: ended.append(info) if bool(info["done"][0]) else None)
    assert ended, "the collision should end the episode under CaRL's rules"
    first = ended[0]
    assert first["episode/infractions/collision_pedestrian"][0] == 1
    assert first["episode/scenarios/DynamicObjectCrossing/triggered"][0] == 1
    assert first["episode/scenarios/DynamicObjectCrossing/collided"][0] == 1
    assert first["episode/scenarios/DynamicObjectCrossing/passed"][0] == 0


def test_a_collision_elsewhere_counts_against_the_live_scenario_but_its_pedestrian_walks_on() -> None:
    """The ego, standing in the trigger circle 14 m before C, is hit elsewhere (a collision counted by the rules)
    while the pedestrian walks: the scenario counts as collided, but the pedestrian keeps 2 m/s (0.2 m per 0.1 s
    step; it stops only when it is the one hit), shown at that speed."""
    env = env_with("DynamicObjectCrossing")
    ped0 = env.scenarios.ped0
    place_in_trigger_circle(env, speed=8.0)  # 14 m / 8 m/s < 2.1 s: it starts at activation
    env.step(torch.tensor([[0.0, -1.0]]))
    while float(env.state.ego_speed[0]) > 0:
        env.step(torch.tensor([[0.0, -1.0]]))
    s = env.state
    assert bool(s.scn.moving[0, 0]) and bool(s.ped.valid[0, ped0])
    y0 = float(s.ped.xy[0, ped0, 1])
    s.counts[0, INFRACTIONS.index("collision_vehicle")] += 1
    for _ in range(5):
        env.step(torch.tensor([[0.0, -1.0]]))
    s = env.state
    assert bool(s.scn.collided[0, 0])
    assert float(s.ped.xy[0, ped0, 1]) - y0 == pytest.approx(5 * 0.2, abs=1e-4)
    assert float(s.ped.speed[0, ped0]) == pytest.approx(2.0)


def test_the_left_turn_stream_keeps_its_speed_and_gaps_and_the_lights_are_forced() -> None:
    """SignalizedJunctionLeftTurn: cars from the opposite (east) approach at 20 m/s = 2 m per step, the next one
    entering once the last is U(25, 50) m from the source (so 25-52 m apart: the last one moves 2 m per step);
    ego light red for 5 s from activation then green, the stream's green, the others (N, S) red."""
    env = env_with("SignalizedJunctionLeftTurn", to="N")
    groups = torch.arange(4).unsqueeze(0)  # E, N, W, S approaches (stop line k has light group k)
    a0 = env.scenarios.veh0
    log = []
    place_in_trigger_circle(env)
    for _ in range(120):
        res = env.step(torch.tensor([[0.0, -1.0]]))
        s = env.state
        log.append((float(s.t[0] - s.scn.t_act[0]), env.light_lookup(s)(groups)[0][0].tolist(),
                    s.veh.xy[0, a0:a0 + 8].clone(), s.veh.valid[0, a0:a0 + 8].clone(), s.veh.speed[0, a0:a0 + 8]))
    assert res.info["episode/scenarios/SignalizedJunctionLeftTurn/triggered"][0] == 1
    for since, lights, _, _, _ in log:
        ego_red = since < 5.0 - 1e-6
        assert lights == [0, 2, 2 if ego_red else 0, 2], (since, lights)  # E (stream) green, W (ego), N, S red
    xs = [x[v][:, 0] for _, _, x, v, _ in log]
    spd = [sp[v] for _, _, _, v, sp in log]
    assert all(torch.allclose(v, torch.full_like(v, 20.0)) for v in spd)
    # cars move 2 m per step towards -x; spacing between neighbours in the stream
    gaps = [float(g) for x in xs[60:] for g in (x.sort().values.diff()) if float(g) < 60]
    assert gaps and min(gaps) > 25.0 - 1e-3 and max(gaps) <= 52.0 + 1e-3
    first = xs[0].max()
    assert float(first) == pytest.approx(HALF + 80.0, abs=2.5)  # the source: 4 v = 80 m before the junction


def test_the_stream_goes_on_after_one_of_its_cars_hit_the_ego() -> None:
    """After a collision with one of its cars the left turn's stream minds vehicles (IDM behind the car ahead: 10-20
    m/s) but keeps coming, as ``ActorFlow`` keeps spawning: with the ego standing in its own lane, out of the stream's
    way, a new car still enters at the source (80 m east of the junction box) each time the last one is U(25, 50) m
    on, so over 120 steps (at least 120 m at 10 m/s or more) at least 120 // 52 = 2 new cars appear. (The stream once
    stopped for good.)"""
    env = env_with("SignalizedJunctionLeftTurn", to="N")
    a0 = env.scenarios.veh0
    place_in_trigger_circle(env)
    for _ in range(20):
        env.step(torch.tensor([[0.0, -1.0]]))
    env.state.scn.hit[0, 0] = True  # one of its cars hit the ego (what scenarios.record sets)
    entered = 0
    for _ in range(120):
        env.step(torch.tensor([[0.0, -1.0]]))
        c, s = env.state.scn, env.state
        new = c.act_alive[0, 0] & (c.act_s[0, 0] == 0)  # the flow group's cars that entered in this step
        entered += int(new.sum())
        xs = s.veh.xy[0, a0:a0 + 8][new]  # the flow group's cars are the first scenario vehicle slots, in order
        assert torch.allclose(xs[:, 0], torch.full_like(xs[:, 0], HALF + 80.0), atol=2.5)  # at the source
    assert entered >= 2
    assert int(env.state.scn.status[0, 0]) == LIVE


def test_a_stream_that_hit_the_ego_queues_behind_it() -> None:
    """The ego stops across the left turn's oncoming stream, inside the junction (a policy that stalls mid-turn); a
    stream car hits it, and from then on the stream minds vehicles (IDM): its cars queue behind the ego and behind
    each other, no two of them overlapping along their path (centres at least the two half lengths apart), and the
    ones standing in the queue stand still. (Minding only the ego, they once all stopped at the same spot.)"""
    env = env_with("SignalizedJunctionLeftTurn", to="N")
    drive(env, 8.0, 400, brake_at_x=-6.0)  # it stops mid-turn across the stream's lane (y = 1.75)
    c = env.state.scn
    assert bool(c.hit[0, 0]), "a stream car should have hit the standing ego"
    alive = c.act_alive[0, 0]
    s_along, half_len, v = c.act_s[0, 0][alive], c.act_half[0, 0, :, 0][alive], c.act_v[0, 0][alive]
    order = s_along.argsort()
    s_along, half_len, v = s_along[order], half_len[order], v[order]
    queued = v < 0.1
    assert int(queued.sum()) >= 2
    gaps = s_along.diff() - (half_len[1:] + half_len[:-1])  # bumper to bumper along the path
    assert (gaps > 0).all(), gaps


def test_the_right_turn_stream_starts_filled_outside_the_junction() -> None:
    """SignalizedJunctionRightTurn: from the ego's left (the north approach, southbound), 100 m before to 60 m past
    the junction; pre-filled every U(25, 50) m except inside the box (|y| < 8)."""
    env = env_with("SignalizedJunctionRightTurn", to="S")
    place_in_trigger_circle(env)
    env.step(torch.tensor([[0.0, -1.0]]))
    a0 = env.scenarios.veh0
    s = env.state
    ys = s.veh.xy[0, a0:a0 + 8][s.veh.valid[0, a0:a0 + 8]]
    assert len(ys) >= 3
    assert torch.allclose(ys[:, 0], torch.full_like(ys[:, 0], -OFF), atol=1e-3)  # the southbound lane
    y = ys[:, 1].sort(descending=True).values
    assert float(y[0]) <= HALF + 100.0 + 1e-3 and not ((y.abs() < HALF - 0.5).any())
    gaps = -y.diff()
    assert (gaps > 25.0 - 2.1).all()  # each 25-50 m, or more across the skipped junction box


def test_control_loss_noise_magnitudes() -> None:
    """While the ego is within 2 m of a debris patch: steer += N(±0.055, 0.015), throttle += N(±0.03, 0.01) per
    20 Hz tick; at the 10 Hz step two ticks averaged: std / sqrt(2). Away from the patches nothing changes."""
    n = 4000
    env = env_with("ControlLoss", num_envs=n)
    s = env.state
    s.scn.status[:] = LIVE
    patch = env.world.scn.patch_xy[0, 0]
    assert patch.tolist() == pytest.approx([-38.0 + 14.0, -OFF], abs=1e-3)  # 14 m on from the trigger's waypoint
    action = torch.tensor([0.0, 0.5]).expand(n, 2)
    s.ego_xy[:] = patch + torch.tensor([0.5, 0.0])
    out = env.scenarios.control(s, action)
    dsteer, dthrottle = out[:, 0], out[:, 1] - 0.5
    assert float(dsteer.abs().mean()) == pytest.approx(0.055, abs=0.002)
    assert float((dsteer.abs() - 0.055).std()) == pytest.approx(0.015 / math.sqrt(2), rel=0.08)
    assert float(dthrottle.abs().mean()) == pytest.approx(0.03, abs=0.002)
    assert float((dthrottle.abs() - 0.03).std()) == pytest.approx(0.01 / math.sqrt(2), rel=0.08)
    assert 0.4 < float((dsteer > 0).float().mean()) < 0.6  # one sign per patch and row, 50/50
    s.ego_xy[:] = patch + torch.tensor([3.0, 0.0])  # left the patch: no noise, and the next patch is due
    assert torch.equal(env.scenarios.control(s, action), action)
    assert (s.scn.patch[:, 0] == 1).all()


def test_a_scenario_timeout_is_scored_0_7_and_pauses_the_blocked_rule() -> None:
    """An ego that never turns across the stream: after 240 s the left turn ends as a timeout (x0.7, the route's
    only infraction) and its stream is removed; the blocked rule (180 s) does not fire while the timeout runs."""
    env = env_with("SignalizedJunctionLeftTurn", to="N", dt=0.5)  # 0.5 s steps: the same rules, fewer steps
    place_in_trigger_circle(env)
    info = {}
    for _ in range(490):
        info = env.step(torch.tensor([[0.0, -1.0]])).info
        if env.state.scn.timed_out[0, 0]:
            break
    s = env.state
    assert bool(s.scn.timed_out[0, 0]) and float(s.t[0] - s.scn.t_act[0]) == pytest.approx(240.0, abs=0.51)
    assert not info["done"][0]  # not blocked at 180 s
    assert info["episode/infractions/scenario_timeout"][0] == 1
    assert float(info["episode/infraction_score"][0]) == pytest.approx(0.7)
    assert not s.veh.valid[0, env.scenarios.veh0:].any()


def test_the_emergency_vehicle_runs_its_red_at_60_kmh_across_the_egos_green() -> None:
    """OppositeVehicleRunningRedLight: hidden until activation, then 30 m up the south approach with emergency
    lights; it starts when the ego is < 2.2 s or < 12 m from the crossing point C = (1.75, -1.75) (the ego's lane
    line meets the northbound one) and drives north at 16.67 m/s; the ego's light is green, every other light of
    the junction red. The ego brakes at x = -12 and stops short of the EV's lane."""
    env = env_with("OppositeVehicleRunningRedLight")
    ev = env.scenarios.veh0 + 8  # the first single-vehicle slot
    assert not env.state.veh.valid[0, ev]
    place_in_trigger_circle(env, 5.0)
    track = []
    drive(env, 5.0, 90, brake_at_x=-12.0, record=lambda s, info: track.append(
        (s.ego_xy[0].clone(), bool(s.veh.valid[0, ev]), s.veh.xy[0, ev].clone(), float(s.veh.speed[0, ev]),
         env.light_lookup(s)(torch.arange(4).unsqueeze(0))[0][0].tolist(), int(s.veh.lights[0, ev]),
         float(s.ego_speed[0]))))
    shown = [k for k, t in enumerate(track) if t[1]]
    assert track[shown[0]][2].tolist() == pytest.approx([OFF, -HALF - 30.0], abs=1.1)
    assert all(track[k][5] & LIGHT_EMERGENCY for k in shown)
    assert track[shown[0]][4] == [2, 2, 0, 2]  # W (ego) green, the rest red
    moved = [k for k in shown if track[k][2][1] > track[shown[0]][2][1] + 1e-3]
    k0 = moved[0]
    # the rule holds at the step it moves first (it moves in the step it starts), not at the one before
    d, v = float((track[k0][0] - torch.tensor([OFF, -OFF])).norm()), track[k0][6]
    assert d / v < 2.2 or d < 12.0
    d, v = float((track[k0 - 1][0] - torch.tensor([OFF, -OFF])).norm()), track[k0 - 1][6]
    assert not (d / v < 2.2 or d < 12.0)
    assert float(track[k0 + 3][2][1] - track[k0][2][1]) == pytest.approx(3 * 60 / 3.6 * 0.1, abs=1e-3)


def test_the_cyclist_stands_visible_before_activation() -> None:
    """VehicleTurningRoute: a bicycle on the right sidewalk 11 m after the junction's exit (on the southbound exit
    after a right turn: the exit begins at y = -8, so C = (-1.75, -19) and the cyclist stands 2.75 m to the right
    of the lane, at x = -4.5), there from the episode's start, facing the road."""
    env = env_with("VehicleTurningRoute", to="S")
    slot = env.scenarios.veh0 + 8
    s = env.state
    assert bool(s.veh.valid[0, slot]) and int(s.scn.status[0, 0]) == 0
    # the route's first 1 m point out of the junction (within a point spacing of the lane's start at y = -8)
    junction = env.world.route_junction[0]
    exit_k = int(torch.nonzero(junction).max()) + 1
    y_exit = float(env.world.route_pts[0, exit_k, 1])
    assert -HALF - 1.5 < y_exit <= -HALF
    assert s.veh.xy[0, slot].tolist() == pytest.approx([-OFF - OFF - 1.0, y_exit - 11.0], abs=0.05)
    assert float(s.veh.yaw[0, slot]) == pytest.approx(0.0, abs=0.05)  # towards the road (east, here)


def test_scenarios_that_cannot_be_placed_are_skipped_with_a_reason() -> None:
    """A right turn needs a junction after its trigger: on a route that ends before the junction it is skipped,
    named, with the reason; the env runs without it."""
    graph = junction_map()
    route = plan_route(graph, np.array([[-HALF - ARM + 5, -OFF], [-HALF - 20, -OFF]]), name="short")
    sd = ScenarioDef("R_1", "SignalizedJunctionRightTurn", (-60.0, -OFF), 0.0)
    route.scenarios = tuple(scenarios_on_route([sd], route.points, "short"))
    cfg = SimConfig(traffic=False, bev=False).validate()
    world = build_world(graph, [route], cfg, torch.device("cpu"))
    (placed,) = world.route_scenarios[0]
    assert not placed.kept and "no junction on the route after its trigger" in placed.reason
    assert not world.has_scenarios
    env = SimEnv(cfg, 1, world=world)
    env.reset()
    env.step(torch.zeros(1, 2))


@pytest.mark.parametrize(("arms", "lit", "why"), [
    ("ENWS", False, "the junction after the trigger has no traffic light on the ego's approach"),
    ("EWS", True, "its junction has no entry lane from the ego's left side")])
def test_a_right_turn_needs_a_light_and_a_stream_from_the_left(arms: str, lit: bool, why: str) -> None:
    """The right turn overrides its junction's lights and draws its stream from the ego's left: at stop signs, or
    at a T whose missing arm is that side (the ego comes from the west and turns south: its left is north), it is
    skipped with that reason; the env runs without it."""
    graph = junction_map(arms, lit=lit)
    route = plan_route(graph, np.array([[-HALF - ARM + 5, -OFF], [-OFF, -HALF - ARM + 5]]), name="r")
    route.scenarios = tuple(scenarios_on_route(
        [ScenarioDef("R_1", "SignalizedJunctionRightTurn", (-38.0, -OFF), 0.0)], route.points, "r"))
    cfg = SimConfig(traffic=False, bev=False).validate()
    world = build_world(graph, [route], cfg, torch.device("cpu"))
    (placed,) = world.route_scenarios[0]
    assert not placed.kept and placed.reason == f"cannot be placed on the map: {why}"
    env = SimEnv(cfg, 1, world=world)
    env.reset()
    env.step(torch.zeros(1, 2))


def test_a_scenario_with_a_bad_parameter_is_skipped_naming_the_file_route_and_parameter(
        caplog: pytest.LogCaptureFixture) -> None:
    """A parameter that is not a number is a setup error: the Leaderboard skips the scenario with a warning and plays
    the rest of the route; so does carl, naming the route file, the route, the scenario and the parameter."""
    graph = junction_map()
    route = plan_route(graph, np.array([[-HALF - ARM + 5, -OFF], [OFF, HALF + ARM - 5]]), name="Town01_3")
    route.source = "route file f.xml: route 3 (Town01_3)"
    defs = [ScenarioDef("W_1", "DynamicObjectCrossing", (-38.0, -OFF), 0.0, {"distance": {"value": "far"}}),
            ScenarioDef("L_1", "SignalizedJunctionLeftTurn", (-38.0, -OFF), 0.0,
                        {"source_dist_interval": {"from": "near", "to": "50"}}),
            ScenarioDef("C_1", "ControlLoss", (-38.0, -OFF), 0.0)]
    route.scenarios = tuple(scenarios_on_route(defs, route.points, route.source))
    cfg = SimConfig(traffic=False, bev=False).validate()
    with caplog.at_level("WARNING"):
        world = build_world(graph, [route], cfg, torch.device("cpu"))
    walker, left, loss = world.route_scenarios[0]
    assert not walker.kept and walker.reason == ("bad parameter: scenario W_1 (DynamicObjectCrossing): parameter "
                                                 "<distance value='far'> is not a number")
    assert not left.kept and "parameter <source_dist_interval from='near'> is not a number" in left.reason
    assert loss.kept and world.has_scenarios
    warned = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("route file f.xml: route 3 (Town01_3): scenario W_1 (DynamicObjectCrossing) skipped")
               for m in warned), warned


def test_training_routes_carry_scenarios_where_each_type_can_be_played() -> None:
    """Random routes: Poisson(density x km) scenarios; a left turn only before a lit junction the route turns left
    at, 15-40 m ahead of it, one per junction however dense (a second flow there would preempt the first); none on
    a route that goes straight on."""
    from envs.sim.scenario_world import random_route_scenarios

    graph = junction_map()
    left = plan_route(graph, np.array([[-HALF - ARM + 5, -OFF], [OFF, HALF + ARM - 5]]), name="left")
    straight = plan_route(graph, np.array([[-HALF - ARM + 5, -OFF], [HALF + ARM - 5, -OFF]]), name="straight")
    only_left = (0.0, 1.0, 0.0, 0.0, 0.0, 0.0)
    rng = np.random.default_rng(0)
    entry = int(np.argmax(graph.is_junction[left.lanes]))
    cum = left.cumulative()
    for _ in range(20):  # Poisson(40/km x ~0.3 km) draws, one junction: one left turn
        (placed,) = random_route_scenarios(graph, left, 40.0, only_left, rng)
        assert placed.kept and placed.defn.type == "SignalizedJunctionLeftTurn"
        assert 15.0 - 1.5 <= cum[entry] - cum[placed.nearest] <= 40.0 + 1.5
    # with the junction taken, the other draws go to the types that need none
    mixed = [random_route_scenarios(graph, left, 40.0, (1.0, 1000.0, 0.0, 0.0, 0.0, 0.0), rng) for _ in range(20)]
    assert all(sum(p.defn.type == "SignalizedJunctionLeftTurn" for p in m) == 1 for m in mixed)
    assert np.mean([len(m) for m in mixed]) == pytest.approx(40.0 * left.length / 1000.0, rel=0.2)
    assert random_route_scenarios(graph, straight, 40.0, only_left, rng) == ()
    # every type: the count follows the density (Poisson mean 40/km x 0.25 km = 10 per route; 60 routes)
    counts = [len(random_route_scenarios(graph, straight, 40.0, (1.0, 0.0, 1.0, 0.0, 0.0, 0.0), rng))
              for _ in range(60)]
    assert np.mean(counts) == pytest.approx(40.0 * straight.length / 1000.0, rel=0.15)


def test_a_training_junction_scenario_triggers_after_the_junction_before_its_own() -> None:
    """A trigger 15-40 m before its junction but behind an earlier junction would play at that one (or be skipped):
    junctions at route points 10-19, 40-49 and 80-89. The first has 10 points before it (under 15 + the 2 m circle
    and a point of margin: no site); the second 20 after the first (a lead of at most 40 - 19 - 3 = 18); the third
    30 (at most 80 - 49 - 3 = 28)."""
    from types import SimpleNamespace

    from envs.sim.scenario_world import _site_leads

    junction = np.zeros(100, bool)
    for a in (10, 40, 80):
        junction[a:a + 10] = True
    assert _site_leads(SimpleNamespace(junction=junction, n=100)) == {40: 18, 80: 28}
    junction[:5] = True  # a route that starts inside a junction: the next one counts from its exit
    assert _site_leads(SimpleNamespace(junction=junction, n=100)) == {40: 18, 80: 28}
    assert _site_leads(SimpleNamespace(junction=np.r_[np.zeros(60, bool), np.ones(5, bool)], n=65)) == {60: 40}


def test_training_routes_carry_junction_scenarios_only_where_their_streams_can_come_from() -> None:
    """A right turn merges into the stream from the ego's left: at a T junction without that arm (west -> south, no
    north arm) none is placed, so none is drawn and then skipped; the same turn at the 4-way junction gets them."""
    from envs.sim.scenario_world import compile_scenarios, random_route_scenarios

    only_right = (0.0, 0.0, 0.0, 1.0, 0.0, 0.0)
    rng = np.random.default_rng(0)
    for arms, playable in (("EWS", False), ("ENWS", True)):
        graph = junction_map(arms)
        right = plan_route(graph, np.array([[-HALF - ARM + 5, -OFF], [-OFF, -HALF - ARM + 5]]), name="right")
        placed = random_route_scenarios(graph, right, 40.0, only_right, rng)
        assert bool(placed) == playable
        if playable:  # and each compiles
            right.scenarios = placed
            _, kept = compile_scenarios(graph, [right], torch.device("cpu"))
            assert all(rs.index >= 0 for rs in kept[0]) and len(kept[0]) == len(placed)


def test_a_curriculum_route_starts_20_to_60_m_before_one_of_its_scenarios() -> None:
    """``scenario_start``: the route is cut to begin U(20, 60) m before a scenario's trigger; the scenarios from there
    on keep their triggers (same route points, indices shifted by the cut), earlier ones are gone; the cut route is
    the old one's tail."""
    from envs.sim.scenario_world import start_before_scenario

    graph = junction_map()
    route = plan_route(graph, np.array([[-HALF - ARM + 5, -OFF], [HALF + ARM - 5, -OFF]]), name="straight")
    defs = [ScenarioDef(f"c{i}", "ControlLoss", (x, -OFF), 0.0) for i, x in enumerate((-110.0, -90.0, -30.0, 60.0))]
    route.scenarios = tuple(scenarios_on_route(defs, route.points, "straight"))
    cum = route.cumulative()
    rng = np.random.default_rng(0)
    starts = []
    for _ in range(40):
        cut = start_before_scenario(route, rng)
        i0 = len(route) - len(cut)
        starts.append(i0)
        np.testing.assert_array_equal(cut.points, route.points[i0:])
        # the scenario it leads to lies 20-60 m (1 m points) after the new start, unless the route had less before
        # it (then the route starts where it did)
        before = [rs for rs in route.scenarios if rs.index >= i0]
        assert [rs.defn.name for rs in cut.scenarios] == [rs.defn.name for rs in before]
        for old, new in zip(before, cut.scenarios):
            assert new.index == old.index - i0 and new.nearest == old.nearest - i0
            np.testing.assert_array_equal(cut.points[new.index], route.points[old.index])
        assert i0 == 0 or any(19.0 <= cum[rs.index] - cum[i0] <= 61.0 for rs in before)
    # only the first scenario (13 m from the start) leaves the start where it was: 1 pick in 4
    assert 20 <= sum(i > 0 for i in starts) <= 38
    with pytest.raises(ConfigError, match=r"env.options.scenario_start=1.5: must be a share in \[0, 1\]"):
        SimConfig(scenario_start=1.5).validate()


@pytest.mark.parametrize("kind, to, removed, kept", [
    # right turn (west -> south): the approach in_W, the source road in_N, the junction, the first 80 m of out_S
    ("SignalizedJunctionRightTurn", "S", [("in_W", 50.0), ("in_N", 60.0), ("junction", 5.0), ("out_S", 70.0)],
     [("out_S", 95.0), ("in_E", 60.0), ("out_E", 30.0), ("in_S", 60.0), ("out_W", 30.0), ("out_N", 30.0)]),
    # left turn (west -> north): the approach, the opposite source in_E and its sink out_W, the first 70 m of out_N
    ("SignalizedJunctionLeftTurn", "N", [("in_W", 50.0), ("in_E", 60.0), ("out_W", 110.0), ("junction", 5.0),
                                         ("out_N", 60.0)],
     [("out_N", 85.0), ("in_N", 60.0), ("in_S", 60.0), ("out_S", 30.0), ("out_E", 30.0)]),
])
def test_junction_scenarios_clear_the_background_traffic(kind: str, to: str, removed: list, kept: list) -> None:
    """``HandleJunctionScenario`` (scenarios.md §3.2-3.3): while the scenario is live, background vehicles in its
    junction, on the ego's approach, on the source (left turn: and sink) road and on the first 80 m (left turn: 70 m)
    of the ego's exit road are removed; the others stay. Lane names as in :func:`junction_map`."""
    env = env_with(kind, to=to)
    graph = env.world.graph
    lane_of = {f"{io}_{k}": 2 * i + (io == "in") for i, k in enumerate(DIRS) for io in ("out", "in")}
    lane_of["junction"] = int(np.nonzero(graph.is_junction)[0][0])
    cars = removed + kept
    bg = env.scenarios.veh0
    assert bg >= len(cars)

    def put() -> None:
        v = env.state.veh
        v.valid[0, :bg] = False
        for k, (name, along) in enumerate(cars):
            v.lane[0, k], v.s[0, k], v.valid[0, k] = lane_of[name], along, True

    put()
    env.scenarios.clear_background(env.state)  # pending: nothing removed
    assert env.state.veh.valid[0, :len(cars)].all()
    place_in_trigger_circle(env)
    env.step(torch.tensor([[0.0, -1.0]]))
    assert int(env.state.scn.status[0, 0]) == LIVE
    put()
    env.scenarios.clear_background(env.state)
    valid = env.state.veh.valid[0, :len(cars)].tolist()
    assert valid == [False] * len(removed) + [True] * len(kept), list(zip(cars, valid))


def test_same_direction_lanes_reach_both_sides() -> None:
    """Three parallel eastbound lanes 0 (left) - 1 - 2 (right) and a westbound one: from the middle lane the
    same-direction lanes are all three, from either edge too; the westbound lane has none but itself."""
    from envs.sim.scenario_world import Roads, _same_direction

    pts = lambda y: np.array([[0.0, y], [50.0, y]])  # noqa: E731
    lanes = [Lane(points=pts(7.0), right=1), Lane(points=pts(3.5), left=0, right=2), Lane(points=pts(0.0), left=1),
             Lane(points=pts(10.5)[::-1].copy())]
    roads = Roads(LaneGraph.build("three", lanes, [], []))
    assert sorted(_same_direction(roads, [1])) == [0, 1, 2]
    assert sorted(_same_direction(roads, [0])) == [0, 1, 2]
    assert sorted(_same_direction(roads, [2, 3])) == [0, 1, 2, 3]


def test_background_traffic_sees_the_scenario_actors_as_if_they_were_more_obstacles() -> None:
    """The traffic checks the scenario actors only on the rows that have any (agents.corridor_gap_rows); its step must
    be the one it takes with those actors appended to its obstacles."""
    import copy

    from envs import make_env
    from envs.sim import agents
    from envs.sim.state import obstacles

    env = make_env("sim", 64, "cpu", 0, bev=False, traffic=True, num_routes=32, scenario_density=12.0,
                   town_seeds=(0, 1))
    env.reset()
    gen = torch.Generator().manual_seed(0)
    st, seen = env.setup, 0
    bg, ped = st.background_vehicles, st.num_pedestrians - st.scenario_slots[1]
    for _ in range(120):
        env.step(torch.rand(64, 2, generator=gen) * torch.tensor([0.2, 1.2]) - torch.tensor([0.1, 0.2]))
        s = env.state
        scenario = obstacles(s, st.ego_half, include_ego=False, include_statics=False, vehicles=slice(bg, None),
                             pedestrians=slice(ped, None))
        if not scenario[-1].any():
            continue
        seen += int(scenario[-1].any(1).sum())
        base = obstacles(s, st.ego_half, include_ego=True, include_statics=False, vehicles=slice(bg),
                         pedestrians=slice(ped))
        lights = env.light_lookup(s)
        veh = env.actors.background(s)
        sparse, dense = copy.deepcopy(veh), copy.deepcopy(veh)
        agents.step_vehicles(st.world, sparse, base, lights, st.cfg, torch.Generator().manual_seed(1), scenario)
        agents.step_vehicles(st.world, dense, tuple(torch.cat(x, 1) for x in zip(base, scenario)), lights, st.cfg,
                             torch.Generator().manual_seed(1))
        for f in ("speed", "s", "lane", "lights"):
            assert torch.equal(getattr(sparse, f), getattr(dense, f)), f
    assert seen > 0  # some rows had scenario actors to see


def test_only_the_row_in_its_trigger_circle_plays_its_scenario_and_gets_its_lights() -> None:
    """Three rows on the left-turn route; only row 1 stands in the trigger circle. Row 1 gets the stream and the forced
    lights (its stream's E green, its own W red for 5 s, N and S red); rows 0 and 2, idle (the step skips them), keep
    the light cycle and show no scenario actor."""
    env = env_with("SignalizedJunctionLeftTurn", to="N", num_envs=3)
    groups = torch.arange(4).unsqueeze(0).expand(3, 4)
    a0 = env.scenarios.veh0
    s, first = env.state, int(env.world.scn.act_first[0])
    s.ego_xy[1] = env.world.route_pts[0, first]
    s.route_idx[1] = s.crit.dev_idx[1] = first
    s.ego_speed[:] = 0.0
    for step in range(40):
        env.step(torch.tensor([[0.0, -1.0]] * 3))
        s = env.state
        lights = env.light_lookup(s)(groups)[0]
        cycle = env.lights.state(s, groups)[0]
        assert torch.equal(lights[[0, 2]], cycle[[0, 2]]), step
        since = float(s.t[1] - s.scn.t_act[1, 0])
        assert lights[1].tolist() == [0, 2, 2 if since < 5.0 - 1e-6 else 0, 2], (since, lights[1])
        assert not s.veh.valid[[0, 2], a0:].any() and not s.ped.valid[[0, 2], env.scenarios.ped0:].any()
        assert s.scn.status[[0, 2], 0].tolist() == [0, 0] and int(s.scn.status[1, 0]) == LIVE
    assert bool(s.veh.valid[1, a0:a0 + 8].any())  # the stream has come


def test_the_step_of_the_busy_rows_alone_is_the_step_of_every_row() -> None:
    """The scenario step plays only rows with a firing or live scenario or a shown actor (and, once more, the rows
    that were busy); an env that plays every row (``keeps_slots`` off, as the CARLA part does) must step the same:
    the same scenario state, observations, rewards and ends, and the same actors wherever they are shown."""
    from envs import make_env
    from envs.sim.expert import Expert

    envs = [make_env("sim", 64, "cpu", 0, bev=False, observation="vector", traffic=False, num_routes=32,
                     scenario_density=12.0, scenario_weights=(1.0,) * 6, town_seeds=(0, 1)) for _ in range(2)]
    envs[1].scenarios.keeps_slots = False
    for env in envs:
        env.reset()
    steer = Expert(envs[0]).steer  # along the route at a steady throttle: scenarios fire, play out and end
    busy_seen, idle_seen, ended = 0, 0, 0
    for _ in range(300):
        action = torch.stack((steer(envs[0].state), torch.full((64,), 0.35)), -1)
        live = envs[0].state.scn.status == LIVE
        busy, every = (env.step(action) for env in envs)
        ended += int((live & (envs[0].state.scn.status == DONE)).sum())
        a, b = (env.state for env in envs)
        for f in ("status", "owner", "act_s", "act_v", "act_alive", "next_gap", "t_act", "fin_m", "moving", "hit",
                  "collided", "timed_out", "preempted", "patch", "near"):
            assert torch.equal(getattr(a.scn, f), getattr(b.scn, f)), f
        for k in busy.obs:
            assert torch.equal(busy.obs[k], every.obs[k]), k
        assert torch.equal(busy.reward, every.reward) and torch.equal(busy.terminated, every.terminated)
        for kind, fields in (("veh", ("xy", "yaw", "speed", "half", "lights")), ("ped", ("xy", "yaw", "speed")),
                             ("statics", ("xy", "yaw", "half"))):
            va, vb = getattr(a, kind).valid, getattr(b, kind).valid
            assert torch.equal(va, vb), kind
            for f in fields:
                assert torch.equal(getattr(getattr(a, kind), f)[va], getattr(getattr(b, kind), f)[vb]), (kind, f)
        n = int(envs[0].scenarios.settling.sum())
        busy_seen, idle_seen = busy_seen + n, idle_seen + 64 - n
    assert busy_seen > 0 and idle_seen > 0 and ended >= 5  # both kinds of row were there, and scenarios ended


def test_a_pedestrian_crossing_ends_40_m_after_its_walker_finished_and_its_group_moves_on_when_idle() -> None:
    """DynamicObjectCrossing ends when the ego has driven 40 m past where it was when the walker finished its crossing
    (the route's only scenario, so also its last, K - 1: that flag was once lost to a scatter). The step skips idle
    rows, but a row whose scenario has just ended is played once more, so its slot group moves on to the route's next
    scenario of the group (here none: owner K = 1) although nothing is live."""
    env = env_with("DynamicObjectCrossing")
    group = int(env.world.scn.group[env.state.scn.scn[0, 0]])
    w, log = env.world, []

    def record(s, info) -> None:  # noqa: ANN001
        log.append((int(s.scn.status[0, 0]), int(s.scn.owner[0, group]), bool(s.scn.act_alive[0].any()),
                    float(w.route_cum[0, s.route_idx[0]]), float(s.scn.fin_m[0, 0])))

    drive(env, 8.0, 140, brake_at_x=-40.0, record=record)  # stop for the walker, who crosses and leaves ...
    drive(env, 8.0, 100, record=record)  # ... then drive on
    fin = next(k for k, x in enumerate(log) if x[4] < math.inf)
    assert not log[fin][2] and log[fin][4] == log[fin][3]  # the walker gone, at the ego's route metres then
    end = next(k for k, x in enumerate(log) if x[0] == DONE)
    assert log[end][3] >= log[fin][4] + 40.0 > log[end - 1][3]
    assert log[end][1] == 0 and log[end + 1][1] == 1  # idle at the next step, and the group has moved on
