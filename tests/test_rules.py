"""CaRL's training rules and Leaderboard 2.0's scoring rules, each pinned by a case whose expectation is computed by
hand from the rule (``../shared/docs/benchmarks.md`` Part A, ``carl-reference.md`` §1), never by the code under test."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from envs import make_env
from envs.config import from_dict
from envs.maps.lanegraph import CONTROL_LIGHT, Lane, LaneGraph, LightGroup, StopLine
from envs.maps.routes import Route
from envs.sim import criteria, infractions
from envs.sim.config import SimConfig
from envs.sim.criteria import CriteriaState
from envs.sim.env import SimEnv
from envs.sim.expert import Expert
from envs.sim.world import build_world
from tests.support.roads import straight

SMALL = dict(town_seeds=(0,), num_routes=32, route_length=(150.0, 250.0), bev=False)


def frozen_env(rules: str = "leaderboard", **kw) -> SimEnv:
    """One row, actors frozen where the test puts them (the scene is the test's, the rules are the code's)."""
    env = make_env("sim", 1, "cpu", 0, **{**SMALL, "rules": rules, "num_vehicles": 2, "num_pedestrians": 2,
                                          "num_statics": 2, **kw})
    env.reset()
    env.actors.step = lambda s, lights: None
    env.actors.refresh = lambda s: None
    for group in (env.state.veh, env.state.ped, env.state.statics):
        group.valid[:] = False
    return env


def place_ahead(env: SimEnv, kind: str, metres: float) -> None:
    """Actor 0 of ``kind`` on the ego's heading, ``metres`` ahead of the ego's centre, standing still."""
    s = env.state
    fwd = torch.stack((torch.cos(s.ego_yaw), torch.sin(s.ego_yaw)), -1)
    group = {"vehicle": s.veh, "pedestrian": s.ped, "static": s.statics}[kind]
    group.xy[:, 0] = s.ego_xy + fwd * metres
    group.yaw[:, 0] = s.ego_yaw
    group.valid[:, 0] = True
    if kind == "vehicle":
        group.speed[:, 0] = 0.0
        group.half[:, 0] = torch.tensor([2.3, 1.0])
    if kind == "static":
        group.half[:, 0] = torch.tensor([2.3, 1.0])


# ------------------------------------------------------------------ Leaderboard coefficients, one case each
@pytest.mark.parametrize("kind,coefficient,key", [("pedestrian", 0.5, "collision_pedestrian"),
                                                  ("vehicle", 0.6, "collision_vehicle"),
                                                  ("static", 0.65, "collision_static")])
def test_collision_coefficient_and_the_route_goes_on(kind, coefficient, key):
    env = frozen_env()
    env.state.ego_speed[:] = 5.0
    place_ahead(env, kind, 8.0)
    for _ in range(20):  # 5 m/s coasting closes the 8 m within ~0.6 s
        r = env.step(torch.zeros(1, 2))
    ep = env.running_episodes()
    assert not r.info["done"][0], "a collision does not end a Leaderboard route"
    assert ep[f"episode/infractions/{key}"][0] == 1.0  # recorded once, not once per tick of overlap
    assert ep["episode/infraction_score"][0] == pytest.approx(coefficient)
    group = {"vehicle": env.state.veh, "pedestrian": env.state.ped, "static": env.state.statics}[kind]
    assert not group.valid[0, 0], "the hit actor must not stay glued to the ego"


def drive_through_control(control: int, red: bool, steps: int = 600, **options) -> dict[str, float]:
    """Expert steering, constant throttle, along the first held-out route with a stop line of ``control`` (1 light,
    2 stop sign); the episode's statistics once it ran that line (or after ``steps``)."""
    options = {**SMALL, "rules": "leaderboard", "traffic": False, "route_split": "eval", **options}
    w = make_env("sim", 1, "cpu", 0, **options).world
    stops = w.route_ev_stop
    route = int(torch.nonzero(((stops >= 0) & (w.stop_control[stops.clamp(min=0)] == control)).any(1))[0])
    env = make_env("sim", 1, "cpu", 0, **options, first_route=route)
    env.reset()
    if red:
        env.lights.state = lambda s, group: (torch.where(group >= 0, 2, 0), torch.zeros_like(group, dtype=torch.float))
    expert = Expert(env)
    key = f"episode/infractions/{'red_light' if control == 1 else 'stop_sign'}"
    for _ in range(steps):
        a = expert(None)
        a[:, 1] = 0.35
        env.step(a)
        ep = env.running_episodes()
        if ep[key][0] > 0:
            break
    return {k: float(v[0]) for k, v in ep.items()}


def test_red_light_coefficient():
    ep = drive_through_control(control=1, red=True)
    assert ep["episode/infractions/red_light"] == 1.0
    assert ep["episode/infractions/outside_lanes"] == 0.0
    assert ep["episode/infraction_score"] == pytest.approx(0.7)


def test_stop_sign_coefficient():
    ep = drive_through_control(control=2, red=False, procedural={"signal_fraction": 0.0})
    assert ep["episode/infractions/stop_sign"] == 1.0
    assert ep["episode/infractions/outside_lanes"] == 0.0
    assert ep["episode/infraction_score"] == pytest.approx(0.8)


def two_lane_approach() -> tuple[LaneGraph, Route]:
    """Two eastward lanes, A (y = 0) and its left neighbour B (y = 3.5), x 0..200, each ending at a stop line of the
    same light, then C (x 200..300, y = 3.5) on from B. The route (1 m points) drives A, changes to B at x = 50 (150
    m before the lines), then B and C."""
    lanes = [Lane(points=straight(0, 200, 0.0), width=3.5, left=1),
             Lane(points=straight(0, 200, 3.5), width=3.5, right=0, successors=[2]),
             Lane(points=straight(200, 300, 3.5), width=3.5)]
    stops = [StopLine(lane=k, control=CONTROL_LIGHT, light_group=0) for k in (0, 1)]
    graph = LaneGraph.build("approach", lanes, stops, [LightGroup(junction=0, phase=0, num_phases=2)])
    xs = np.arange(0, 300, dtype=np.float32)
    route = Route("r", np.stack([xs, np.where(xs < 50, 0.0, 3.5)], 1).astype(np.float32),
                  np.where(xs < 50, 0, np.where(xs < 200, 1, 2)).astype(np.int32))
    return graph, route


def test_a_lane_change_off_a_lit_lane_runs_no_light_and_the_line_it_crosses_counts_once():
    """A route leaves lane A by a lane change 150 m before A's stop line, so it never crosses that line: the red light
    counts once, where the ego's tail passes B's line (route point 199 at x = 199, B's last point before C), and not at
    the lane change."""
    graph, route = two_lane_approach()
    cfg = from_dict(SimConfig, {"traffic": False, "bev": False, "rules": "leaderboard"}, "env.options").validate()
    env = SimEnv(cfg, 1, world=build_world(graph, [route], cfg, torch.device("cpu")))
    assert env.world.route_ev_stop[0][env.world.route_ev_stop[0] >= 0].tolist() == [1]  # B's line only
    assert env.world.route_ev_idx[0, 0].item() == 199
    env.reset()
    env.lights.state = lambda s, group: (torch.where(group >= 0, 2, 0), torch.zeros_like(group, dtype=torch.float))
    expert = Expert(env)
    crossings = []
    for _ in range(400):
        a = expert(None)
        a[:, 1] = 0.35  # constant throttle through the red
        env.step(a)
        crossings.append((env.state.ego_xy[0, 0].item(), env.running_episodes()["episode/infractions/red_light"][0]))
        if crossings[-1][0] > 240.0:
            break
    assert crossings[-1][0] > 240.0, "the ego must drive past the line"
    assert max(n for x, n in crossings if x < 195.0) == 0.0  # nothing at the lane change (x = 50) or before the line
    assert crossings[-1][1] == 1.0


def test_a_stopped_ego_that_is_hit_records_nothing():
    env = frozen_env()
    place_ahead(env, "vehicle", 3.0)  # overlapping the standing ego
    for _ in range(5):
        env.step(torch.tensor([[0.0, -1.0]]))
    assert env.running_episodes()["episode/infractions/collision_vehicle"][0] == 0.0
    assert env.running_episodes()["episode/infraction_score"][0] == 1.0


def test_collision_merging_by_place_and_actor():
    """CollisionTest: same actor within 5 s, or within 5 m of the last collision: one collision."""
    st = CriteriaState.zeros(1, torch.device("cpu"))
    veh, ped = torch.tensor([0]), torch.tensor([1])
    key = lambda c, i: torch.tensor([c * 1_000_000 + i])  # noqa: E731
    fast = torch.tensor([5.0])

    def hit(cls, k, x, t):
        return bool(criteria.record_collisions(st, cls, k, torch.tensor([[x, 0.0]]), fast, torch.tensor([t]))[0])

    assert hit(veh, key(0, 3), 0.0, 0.0)  # first: recorded
    assert not hit(ped, key(1, 0), 4.0, 1.0)  # another actor 4 m away: within 5 m of the last one
    assert not hit(veh, key(0, 3), 20.0, 4.0)  # the same vehicle 4 s later, far away: same collision
    assert hit(veh, key(0, 3), 40.0, 5.5)  # the same vehicle 5.5 s later, 40 m away: a new one
    assert hit(ped, key(1, 0), 46.0, 5.6)  # 6 m from the last one: new
    assert not hit(veh, key(0, 7), 50.0, 6.0)  # 4 m from the last one: the same collision
    slow = criteria.record_collisions(st, veh, key(0, 8), torch.tensor([[90.0, 0.0]]), torch.tensor([0.05]),
                                      torch.tensor([20.0]))
    assert not bool(slow[0])  # the ego below 0.1 m/s is not at fault


def test_mean_of_route_scores_is_not_the_product_of_means():
    from carl.eval.store import summarize
    from envs.metrics.leaderboard import make_record

    def ep(rc, score):
        return {"episode/route_completion": rc, "episode/infraction_score": score, "episode/length": 10.0,
                "episode/termination/route_completed": 1.0}

    records = [make_record(0, "a", ep(100.0, 1.0), 1000.0, "g", 0, 1.0, 0.1),
               make_record(1, "b", ep(50.0, 0.5), 1000.0, "g", 1, 1.0, 0.1)]
    summary = summarize(records, 2)
    assert summary["driving_score"] == pytest.approx((100.0 + 25.0) / 2)  # 62.5
    assert summary["route_completion"] == pytest.approx(75.0)
    assert summary["infraction_score"] == pytest.approx(0.75)
    assert summary["route_completion"] * summary["infraction_score"] == pytest.approx(56.25)  # != 62.5
    assert summary["km"] == pytest.approx(1.0 + 0.5)  # km driven: length x RC


def test_the_global_record_counts_outside_lanes_in_km_and_the_rest_per_km():
    """The Leaderboard's statistics: every infraction entry is events / km driven, except the route lanes', the km
    driven outside them in total, read from the message's 9th word (its OutsideRouteLanesTest's wording). Route a
    (1,000 m, RC 100): 2.5 % outside = 25 m, one vehicle collision; route b (2,000 m, RC 50): 1 % of its length =
    20 m, no collision. km driven 1.0 + 1.0 = 2.0: 0.5 vehicle collisions per km, 0.045 km outside the lanes. A
    record worded as carl wrote it before (the % only) gives the same km from its % and route length."""
    from carl.eval.store import summarize
    from envs.metrics.leaderboard import lb_global_infraction, make_record

    def ep(rc, outside_pct, collisions):
        return {"episode/route_completion": rc, "episode/infraction_score": 1.0, "episode/length": 10.0,
                "episode/termination/route_completed": 1.0, "episode/infractions/outside_lanes": 1.0,
                "episode/outside_lanes_pct": outside_pct, "episode/infractions/collision_vehicle": collisions}

    records = [make_record(0, "a", ep(100.0, 2.5, 1.0), 1000.0, "g", 0, 1.0, 0.1),
               make_record(1, "b", ep(50.0, 1.0, 0.0), 2000.0, "g", 1, 1.0, 0.1)]
    assert records[0]["infractions"]["outside_route_lanes"] == [
        "Agent went outside its route lanes for about 25.000 meters (2.50% of the completed route)"]
    per_km = summarize(records, 2)["infractions_per_km_lb"]
    assert per_km["collisions_vehicle"] == pytest.approx(0.5)
    assert per_km["outside_route_lanes"] == pytest.approx(0.045)
    records[1]["infractions"]["outside_route_lanes"] = ["Agent went outside its route lanes for about 1.000% of "
                                                        "the route (1 times)"]
    assert lb_global_infraction(records, "outside_route_lanes", 2.0) == pytest.approx(0.045)


def test_ds_lost_splits_100_minus_ds_among_its_causes():
    """Route a: RC 80 (blocked), one vehicle collision (x0.6) and a min-speed factor of 0.9: IS 0.54, DS 43.2; the
    missed 20 go to the block, RC x (1 - IS) = 36.8 by log 0.6 : log 0.9. Route b: RC 100, two walkers hit (x0.5
    each) and a scenario timeout (x0.7): IS 0.175, DS 17.5; 82.5 by 2 log 0.5 : log 0.7."""
    from carl.eval.report import ds_lost_table
    from carl.eval.store import summarize
    from envs.metrics.leaderboard import make_record

    a = {"episode/route_completion": 80.0, "episode/infraction_score": 0.54, "episode/termination/blocked": 1.0,
         "episode/infractions/collision_vehicle": 1.0, "episode/min_speed_factor": 0.9, "episode/length": 10.0}
    b = {"episode/route_completion": 100.0, "episode/infraction_score": 0.175, "episode/length": 10.0,
         "episode/termination/route_completed": 1.0, "episode/infractions/collision_pedestrian": 2.0,
         "episode/infractions/scenario_timeout": 1.0, "episode/min_speed_factor": 1.0}
    records = [make_record(i, n, e, 1000.0, "g", i, 1.0, 0.1) for i, (n, e) in enumerate((("a", a), ("b", b)))]
    lost = summarize(records, 2)["ds_lost"]
    vehicle_a = 36.8 * math.log(0.6) / (math.log(0.6) + math.log(0.9))  # 30.507
    walkers_b = 82.5 * 2 * math.log(0.5) / (2 * math.log(0.5) + math.log(0.7))  # 65.617
    assert lost == pytest.approx({"incomplete/blocked": 10.0, "collision_vehicle": vehicle_a / 2,
                                  "min_speed": (36.8 - vehicle_a) / 2, "collision_pedestrian": walkers_b / 2,
                                  "scenario_timeout": (82.5 - walkers_b) / 2})
    assert list(lost)[0] == "collision_pedestrian"  # largest first
    assert sum(lost.values()) == pytest.approx(100.0 - (43.2 + 17.5) / 2)
    md = "\n".join(ds_lost_table({"p": summarize(records, 2)}))
    assert "| incomplete/blocked | 10.00 |" in md and "| driving score | 30.35 |" in md


def test_route_timeout_formula():
    """300 s plus, per metre of progress, 1 / (10 % of the speed limit) seconds."""
    st = CriteriaState.zeros(2, torch.device("cpu"))
    criteria.extend_timeout(st, torch.tensor([100.0, 50.0]), torch.tensor([50 / 3.6, 30 / 3.6]))
    criteria.extend_timeout(st, torch.tensor([0.0, 50.0]), torch.tensor([50 / 3.6, 90 / 3.6]))
    assert st.timeout[0] == pytest.approx(300 + 100 / (0.1 * 50 / 3.6))  # 372.0 s
    assert st.timeout[1] == pytest.approx(300 + 50 / (0.1 * 30 / 3.6) + 50 / (0.1 * 90 / 3.6))  # 380.0 s


def test_route_timeout_ends_a_creeping_route():
    """An ego creeping at v m/s under limit L gets T = 300 + v T / (0.1 L), i.e. T = 300 / (1 - v / (0.1 L))."""
    env = frozen_env(dt=1.0)  # 1 s ticks keep the test short
    limit = 10.0
    env.setup.world = dataclasses.replace(env.world, lane_speed=torch.full_like(env.world.lane_speed, limit))
    w, s = env.world, env.state
    v = 0.25

    def creep(state, action):  # the ego slides along its route at exactly v
        k = (state.route_idx + 1).clamp(max=int(w.route_n[state.route_id[0]]) - 1)
        d = w.route_pts[state.route_id, k] - state.ego_xy
        state.ego_xy = state.ego_xy + d / d.norm(dim=-1, keepdim=True) * v * env.cfg.dt
        state.ego_yaw = torch.atan2(d[:, 1], d[:, 0])
        state.ego_speed = torch.full_like(state.ego_speed, v)

    env.ego.step = creep
    expected = 300.0 / (1.0 - v / (0.1 * limit))  # 400 s
    assert expected < float(w.route_len[s.route_id[0]]) / v  # it times out before it arrives
    for _ in range(int(expected) + 20):
        r = env.step(torch.zeros(1, 2))
        if r.info["done"][0]:
            break
    assert r.info["episode/termination/timeout"][0] == 1.0
    assert r.info["episode/length"][0] * 1.0 == pytest.approx(expected, abs=5.0)  # credit per 1 m route point


@pytest.mark.parametrize("rules,seconds", [("leaderboard", 180.0), ("carl", 90.0)])
def test_blocked_time(rules, seconds):
    env = frozen_env(rules, dt=0.5)
    for _ in range(int(seconds * 2) + 20):
        r = env.step(torch.tensor([[0.0, -1.0]]))
        if r.info["done"][0]:
            break
    assert r.info["episode/termination/blocked"][0] == 1.0
    assert r.info["episode/length"][0] == int(seconds * 2) + 1  # still for more than `seconds`


def test_min_speed_checkpoints():
    """Route 400 m: checkpoints when 100 m more were reached; pct = ego mean / traffic mean; factor 1 - 0.3 (1 - pct)."""
    st = CriteriaState.zeros(1, torch.device("cpu"))
    L = torch.tensor([400.0])

    def tick(route_m, ego, traffic, has=True, ends=False):
        return bool(criteria.update_min_speed(st, torch.tensor([route_m]), L, torch.tensor([ego]),
                                              torch.tensor([traffic]), torch.tensor([has]), torch.tensor([ends]))[0])

    for m in range(0, 101, 10):  # first quarter: ego 5, traffic 10
        assert not tick(float(m), 5.0, 10.0)
    assert tick(101.0, 9.0, 9.0)  # > 100 m: scored before this tick's sample: 50 % -> 0.85
    for m in range(110, 202, 10):  # second quarter: as fast as the traffic
        assert not tick(float(m), 9.0, 9.0)
    assert not tick(202.0, 0.0, 0.0, has=False)  # 100 %: no infraction
    for m in range(210, 302, 10):  # third quarter: no traffic at all
        assert not tick(float(m), 0.0, 0.0, has=False)
    assert not tick(303.0, 2.0, 8.0)  # no samples -> 100 %
    for m in range(310, 380, 10):
        tick(float(m), 2.0, 8.0)
    assert tick(390.0, 2.0, 8.0, ends=True)  # the route ends at 97.5 % > 95 %: 25 % -> 0.775
    assert int(st.ms_events) == 2
    assert float(st.ms_factor) == pytest.approx(0.85 * 0.775)


def test_completed_route_counts_as_100_and_every_route_ends():
    env = make_env("sim", 2, "cpu", 0, **{**SMALL, "rules": "leaderboard", "traffic": False, "route_split": "eval",
                                          "route_length": (60.0, 90.0)})
    expert = Expert(env)
    obs = env.reset()
    done = {}
    for _ in range(env.max_episode_steps):
        r = env.step(expert(obs))
        obs = r.obs
        for b in torch.nonzero(r.info["done"]).flatten().tolist():
            done.setdefault(b, float(r.info["episode/route_completion"][b]))
        if len(done) == 2:
            break
    assert sorted(done.values()) == [100.0] * 2


# ------------------------------------------------------------------ CaRL's training rules
def test_route_completion_advances_over_the_next_three_points():
    w = straight_route_world(frozen_env("carl"))
    rid, zero = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    progress = lambda x, idx=zero: int(infractions.route_progress(w, rid, idx, torch.tensor([[x, 3.0]]))[0])  # noqa
    assert progress(10.5) == 2  # 10 points passed: only the next 3 (0, 1, 2) are looked at
    assert progress(1.5) == 1  # points 0 and 1 passed (positive dot product), point 2 not
    assert progress(-0.5) == 0  # behind the start
    assert progress(4.5, torch.tensor([3])) == 4  # never backwards, furthest passed in 3..5


def straight_route_world(env: SimEnv, points: int = 200):
    """The env's world with one straight route along +x, 1 m between points."""
    x = torch.arange(points, dtype=torch.float32)
    pts = torch.stack((x, torch.zeros_like(x)), -1).unsqueeze(0)
    return dataclasses.replace(env.world, route_pts=pts, route_cum=x.unsqueeze(0), route_len=x[-1:].clone(),
                               route_n=torch.tensor([points]))


def test_route_deviation_both_rules():
    env = frozen_env("carl")
    w = straight_route_world(env)  # 199 m long
    rid, zero = torch.zeros(1, dtype=torch.long), torch.zeros(1)

    def check(xy, idx, out):
        return infractions.route_deviation(w, rid, idx, torch.tensor([xy]), out, 15.0, 30.0, 0.3)

    # rule 1: 30 m from the nearest point -> deviated at once; 29.9 m -> not
    assert bool(check([5.0, 30.0], rid, zero)[0][0])
    assert not bool(check([5.0, 29.9], rid, zero)[0][0])
    # rule 2: 20 m beside the route, the route progress made there counts; 0.3 x 199 m = 59.7 m: fires at x = 60
    idx, out = rid.clone(), zero.clone()
    for k in range(1, 199):
        dev, idx, out = check([float(k), 20.0], idx, out)
        assert int(idx[0]) == k
        if bool(dev[0]):
            break
    assert k == 60 and float(out[0]) == 60.0
    # 14 m beside it is "safe": never deviated
    idx, out = rid.clone(), zero.clone()
    for k in range(1, 199):
        dev, idx, out = check([float(k), 14.0], idx, out)
        assert not bool(dev[0])
    # the window: a jump of 8 points ahead reaches only 5 of them
    assert int(check([8.0, 0.0], rid, zero)[1][0]) == 5


def test_wrong_way_rule():
    def lane(idx, yaw, junction):
        return {"lane": torch.tensor([idx]), "lane_yaw": torch.tensor([yaw]), "junction": torch.tensor([junction]),
                "found": torch.tensor([True])}

    def step(lane_now, ego_yaw, prev, active):
        return bool(infractions.wrong_way(lane_now, torch.tensor([ego_yaw]), torch.tensor([prev[0]]),
                                          torch.tensor([prev[1]]), torch.tensor([prev[2]]), torch.tensor([active]))[0])

    deg = math.radians
    # a lane change outside junctions onto a lane heading 180 deg the other way flips to wrong, and back
    assert step(lane(2, deg(180), False), 0.0, (1, 0.0, False), False)
    assert not step(lane(1, 0.0, False), deg(180), (2, deg(180), False), True)
    # a 140 deg lane-heading jump is not enough (> 150 needed)
    assert not step(lane(2, deg(140), False), 0.0, (1, 0.0, False), False)
    # leaving a junction: wrong when heading more than 120 deg off the lane
    assert step(lane(3, 0.0, False), deg(130), (9, deg(90), True), False)
    assert not step(lane(3, 0.0, False), deg(110), (9, deg(90), True), False)
    # inside a junction: never wrong way
    assert not step(lane(9, 0.0, True), deg(180), (3, 0.0, False), True)
    # the same lane: the state holds
    assert step(lane(2, deg(180), False), 0.0, (2, deg(180), False), True)


def test_ttc_sees_every_actor():
    """The one actor on a collision course is the farthest of 12; a nearest-6 cap would miss it."""
    B, N = 1, 12
    xy = torch.zeros(B, N, 2)
    xy[0, :11, 0] = torch.arange(11) * 1.0 - 12.0  # parked behind the ego
    xy[0, :11, 1] = 6.0
    xy[0, 11] = torch.tensor([16.0, 0.0])  # ahead on the ego's path, oncoming at 10 m/s
    yaw = torch.zeros(B, N)
    yaw[0, 11] = math.pi
    speed = torch.zeros(B, N)
    speed[0, 11] = 10.0
    half = torch.tensor([2.3, 1.0]).expand(B, N, 2)
    hit = infractions.ttc_violation(torch.zeros(B, 2), torch.zeros(B), torch.tensor([8.0]), torch.tensor([[2.45, 1.05]]),
                                    xy, yaw, speed, half, torch.ones(B, N, dtype=torch.bool), (0.1, 0.3, 0.5, 0.7, 0.9))
    # gap 16 - 2.45 - 2.3 = 11.25 m closing at 18 m/s: overlap by 0.7 s
    assert bool(hit[0])


def test_ttc_gathers_every_actor_that_can_reach_the_ego_in_time():
    """Actors are boxed only if they can reach the ego by the last TTC time; a fast one from far still counts.

    Ego at 8 m/s, half extent (2.45, 1.05); times up to 0.9 s. Row 0: one oncoming car at 25 m/s, 30 m ahead in slot 5
    (the others empty): the gap 30 - 2.45 - 2.3 = 25.25 m closes at 33 m/s, so the boxes overlap at 0.77 s. Row 1: the
    same car 40 m ahead (35.25 m at 33 m/s: 1.07 s, too late) and five parked cars beside the road, 6 m to the left."""
    B, N = 2, 8
    xy, yaw, speed = torch.zeros(B, N, 2), torch.zeros(B, N), torch.zeros(B, N)
    valid = torch.zeros(B, N, dtype=torch.bool)
    xy[0, 5], xy[1, 5] = torch.tensor([30.0, 0.0]), torch.tensor([40.0, 0.0])
    yaw[:, 5], speed[:, 5], valid[:, 5] = math.pi, 25.0, True
    xy[1, :5, 0], xy[1, :5, 1], valid[1, :5] = torch.arange(5) * 6.0 - 6.0, 6.0, True
    half = torch.tensor([2.3, 1.0]).expand(B, N, 2)
    hit = infractions.ttc_violation(torch.zeros(B, 2), torch.zeros(B), torch.full((B,), 8.0),
                                    torch.tensor([[2.45, 1.05]]).expand(B, 2), xy, yaw, speed, half, valid,
                                    (0.1, 0.3, 0.5, 0.7, 0.9))
    assert hit.tolist() == [True, False]


def test_lane_measures_follow_a_width_taper():
    """Lane -1 of tests/data/xodr/width_taper.xodr widens from 3.0 m (x = 0) to 4.5 m (x = 75): the lane-centre factor
    and the outside-lanes rule use the width where the ego is, not one width per lane."""
    from pathlib import Path

    xodr = Path(__file__).parent / "data" / "xodr" / "width_taper.xodr"
    env = make_env("sim", 1, "cpu", 0, map=str(xodr), bev=False, traffic=False, num_routes=4,
                   route_length=(40.0, 120.0))
    yaw = torch.zeros(1)
    wide = infractions.lane_measures(env.world, torch.tensor([[75.0, -2.25 - 2.0]]), yaw)  # 2.0 m right of centre
    assert not bool(wide["off_lane"][0])
    assert float(wide["lane_ratio"][0]) == pytest.approx(2.0 / 2.25, abs=0.03)
    narrow = infractions.lane_measures(env.world, torch.tensor([[2.0, -1.5 - 1.2]]), yaw)  # w(2) ~ 3.0 m
    assert float(narrow["lane_ratio"][0]) == pytest.approx(1.2 / 1.5, abs=0.03)


def test_moving_box_overlap_matches_the_overlap_of_moved_boxes():
    from envs.sim.geometry import boxes_overlap, boxes_overlap_moving

    g = torch.Generator().manual_seed(0)
    n = 4000
    c1, c2 = torch.rand(n, 2, generator=g) * 20, torch.rand(n, 2, generator=g) * 20
    y1, y2 = torch.rand(n, generator=g) * 7, torch.rand(n, generator=g) * 7
    h1, h2 = 0.3 + torch.rand(n, 2, generator=g) * 3, 0.3 + torch.rand(n, 2, generator=g) * 3
    v1, v2 = (torch.rand(n, 2, generator=g) - 0.5) * 30, (torch.rand(n, 2, generator=g) - 0.5) * 30
    times = torch.tensor([0.1, 0.5, 0.9])
    got = boxes_overlap_moving(c1, y1, h1, v1, c2, y2, h2, v2, times)
    for k, t in enumerate(times):
        want = boxes_overlap(c1 + v1 * t, y1, h1, c2 + v2 * t, y2, h2)
        assert (got[:, k] == want).float().mean() > 0.999  # float rounding at touching boxes only
    assert got.any() and not got.all()
