"""The CARLA worker through the real ``carla`` 0.9.16 client against the protocol stand-in.

Every client runs in a subprocess (a malformed stream aborts the client's process): scripts run with
``subprocess``, and :class:`envs.carla.vector.CarlaVectorEnv` keeps its workers in subprocesses by design.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from envs.carla.servers import CarlaServer, PortAllocator
from envs.carla.vector import make_carla_env
from envs.carla.worker import CarlaError
from envs.maps.opendrive import default_maps_dir
from envs.config import ConfigError
from tests.support.processes import standin_executable

MAPS = default_maps_dir()
TOWN01 = MAPS / "Town01.xodr" if MAPS else None
pytestmark = [pytest.mark.carla,
              pytest.mark.skipif(TOWN01 is None or not TOWN01.is_file(), reason="CARLA town maps not available")]
ROOT = Path(__file__).resolve().parents[1]


def run_script(code: str, *args: str, timeout: float = 120.0) -> dict:
    """Run ``code`` in a fresh interpreter (cwd = repo root); it prints one JSON line last."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def standin(tmp_path: Path):
    """A stand-in server owned by the test process: started here, killed by its process group in teardown, also when
    the client subprocess aborts."""
    srv = CarlaServer(standin_executable(tmp_path, TOWN01, MAPS), PortAllocator(base=23600).allocate(), tmp_path,
                      ready_timeout=30)
    srv.start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


CLIENT = """
    import json, sys, carla
    port = int(sys.argv[1])
    c = carla.Client("127.0.0.1", port); c.set_timeout(5.0)
    world = c.load_world("Town02")
    out = {"map": world.get_map().name}
    s = world.get_settings(); s.synchronous_mode = True; s.fixed_delta_seconds = 0.1; world.apply_settings(s)
    bp = world.get_blueprint_library().find("vehicle.lincoln.mkz_2020")
    v = world.spawn_actor(bp, carla.Transform(carla.Location(x=10, y=2, z=0.5), carla.Rotation(yaw=90)))
    w = world.spawn_actor(world.get_blueprint_library().filter("walker.*")[0],
                          carla.Transform(carla.Location(x=30, y=0, z=1.0)))
    v.apply_control(carla.VehicleControl(throttle=1.0))
    frames = [world.tick() for _ in range(10)]
    out["frames_increase"] = all(b == a + 1 for a, b in zip(frames, frames[1:]))
    t, vel = v.get_transform(), v.get_velocity()
    out["moved_y"], out["speed"], out["x"] = t.location.y - 2.0, vel.length(), t.location.x
    out["actors"] = sorted(a.type_id for a in world.get_actors())
    try:
        c.load_world("Town99")
        out["unknown_town"] = "no error"
    except RuntimeError as e:
        out["unknown_town"] = str(e)
    print(json.dumps(out))
"""


def test_real_client_against_standin(standin) -> None:
    r = run_script(CLIENT, str(standin.ports.rpc))
    assert r["map"].endswith("Town02") and r["frames_increase"]
    assert r["moved_y"] > 1.5 and abs(r["x"] - 10.0) < 1e-3 and 3.0 < r["speed"] < 6.0  # yaw 90 = CARLA +y
    actors = [a for a in r["actors"] if a != "traffic.traffic_light"]  # the map's lights are actors too
    assert len(actors) < len(r["actors"])
    assert actors[:2] == ["spectator", "vehicle.lincoln.mkz_2020"] and actors[2].startswith("walker.")
    assert "map not found" in r["unknown_town"]


CONTROL_STEP = """
    import json, sys, torch
    from envs.carla.config import split_options
    from envs.carla.worker import build_carla_env
    rpc, tm = int(sys.argv[1]), int(sys.argv[2])
    cc, sc = split_options(dict(town="Town01", traffic_vehicles=0, traffic_pedestrians=0, bev_size=32, bev_ppm=1.0,
                                bev_ego_from_bottom=10, route_split="eval", num_routes=4, dt=0.05))
    w = build_carla_env(cc, sc, rpc, tm, seed=0)
    w.reset(seed=0)
    t0 = w.data.cworld.get_snapshot().timestamp.elapsed_seconds
    for _ in range(4):
        w.step(torch.tensor([[0.0, 0.5]]))
    t1 = w.data.cworld.get_snapshot().timestamp.elapsed_seconds
    out = {"fixed": w.data.cworld.get_settings().fixed_delta_seconds, "elapsed": t1 - t0}
    w.close()
    print(json.dumps(out))
"""


def test_the_server_ticks_the_env_control_step(standin) -> None:
    """env.options.dt is the server's fixed step: 4 control steps of 0.05 s advance CARLA's clock by 0.2 s (the
    worker used to set 0.1 s whatever dt said)."""
    r = run_script(CONTROL_STEP, str(standin.ports.rpc), str(standin.ports.tm))
    assert abs(r["fixed"] - 0.05) < 1e-9 and abs(r["elapsed"] - 0.2) < 1e-6, r


EQUALITY = """
    import json, sys, torch
    from pathlib import Path
    from envs.carla.config import split_options
    from envs.carla.worker import build_carla_env
    from envs.sim.env import SimEnv
    rpc, tm = int(sys.argv[1]), int(sys.argv[2])
    cc, sc = split_options(dict(town="Town01", traffic_vehicles=0, traffic_pedestrians=0, traffic=False,
                                bev_size=64, route_split="eval", num_routes=16, carla_lights=False))
    w = build_carla_env(cc, sc, rpc, tm, seed=3)
    sim = SimEnv(sc, 1, "cpu", seed=3)
    diff = lambda a, b: {k: float((a[k].float() - b[k].float()).abs().max()) for k in a}
    out = {"reset": diff(w.reset(seed=3), sim.reset(seed=3))}
    act = torch.tensor([[0.3, 0.7]])
    out["step1"] = diff(w.step(act).obs, sim.step(act).obs)
    for _ in range(4):
        a, b = w.step(act), sim.step(act)
    out["step5"] = diff(a.obs, b.obs)
    out["reward5"] = float((a.reward - b.reward).abs().max())
    w.close()
    print(json.dumps(out))
"""


def test_first_observations_equal_the_builtin_simulator(standin) -> None:
    """Same route, same actions, no traffic, the simulator's light cycle (``carla_lights=False``): bitwise on reset and
    on the first step's BEV (the stand-in moves the ego with the simulator's bicycle and gearbox); the ego-frame
    velocity comes back through CARLA's float32 world-frame velocity (< 1e-6), and float32 pose round trips allow
    1e-5 on measurements later."""
    r = run_script(EQUALITY, str(standin.ports.rpc), str(standin.ports.tm))
    assert r["reset"] == {"measurements": 0.0, "value_measurements": 0.0, "bev": 0.0}
    assert r["step1"]["bev"] == 0.0 and r["step1"]["value_measurements"] == 0.0, r
    assert r["step1"]["measurements"] < 1e-6, r
    assert r["step5"]["measurements"] < 1e-5 and r["step5"]["value_measurements"] < 1e-5
    assert r["step5"]["bev"] <= 255 and r["reward5"] < 1e-4


POLICY_EQUALITY = """
    import json, sys, torch
    import carl
    from envs.carla.config import split_options
    from envs.carla.worker import build_carla_env
    from envs.sim.env import SimEnv
    rpc, tm, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    policy, spec = carl.load_policy(ckpt)
    cc, sc = split_options(dict(town="Town01", traffic_vehicles=0, traffic_pedestrians=0, traffic=False,
                                bev_size=64, route_split="eval", num_routes=16, carla_lights=False))
    w = build_carla_env(cc, sc, rpc, tm, seed=5)
    sim = SimEnv(sc, 1, "cpu", seed=5)
    diff = lambda a, b: {k: float((a[k].float() - b[k].float()).abs().max()) for k in a}
    ow, os_ = w.reset(seed=5), sim.reset(seed=5)
    out = {"reset": diff(ow, os_), "actions": []}
    for _ in range(3):
        aw, as_ = policy(ow), policy(os_)
        out["actions"].append(float((aw - as_).abs().max()))
        ow, os_ = w.step(aw).obs, sim.step(as_).obs
    out["step3"] = diff(ow, os_)
    out["moved"] = float(ow["measurements"][0, 6])
    w.close()
    print(json.dumps(out))
"""


def test_trained_policy_sees_the_same_first_observations(standin, tmp_path: Path) -> None:
    """A checkpoint trained (one PPO update) in the built-in simulator drives the same route through the real client
    and the stand-in and through the simulator: identical BEVs and actions for three steps, measurements within the
    float32 velocity round trip (no traffic, the simulator's light cycle)."""
    run = tmp_path / "run"
    train = subprocess.run([sys.executable, "-m", "carl.train", "env.num_envs=2", "ppo.num_steps=16",
                            "ppo.minibatch_size=16", "ppo.update_epochs=1", "ppo.total_timesteps=32",
                            "model.features_dim=32", "model.hidden_dim=32", "model.fusion_dim=64",
                            "env.options.bev_size=64", "++env.options.town_seeds=[0]", "++env.options.num_routes=16",
                            "logging.eval_episodes=0", "logging.final_baselines=false", "logging.progress_bar=false",
                            f"run_dir={run}"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert train.returncode == 0, train.stderr[-3000:]
    r = run_script(POLICY_EQUALITY, str(standin.ports.rpc), str(standin.ports.tm), str(run / "last.pt"))
    assert r["reset"] == {"measurements": 0.0, "value_measurements": 0.0, "bev": 0.0}
    assert max(r["actions"]) < 1e-6, r  # same observation, same deterministic action, step after step
    assert r["step3"]["bev"] == 0.0 and r["step3"]["value_measurements"] == 0.0, r
    assert r["step3"]["measurements"] < 1e-6 and r["moved"] > 0.0, r


@pytest.mark.parametrize("traffic", [
    0,  # the worker notices the time-out, restarts its server, reconnects with a new client
    pytest.param(4, marks=pytest.mark.slow),  # the client-side Traffic Manager aborts the worker process on the
    # time-out (std::terminate): the vector env kills the server's process group and replaces the worker
])
def test_vector_env_survives_a_server_crash(tmp_path: Path, traffic: int) -> None:
    env = make_carla_env(1, "cpu", seed=0, town="Town01", executable=str(standin_executable(tmp_path, TOWN01)),
                         base_port=23800, log_dir=str(tmp_path / "logs"), traffic_vehicles=traffic,
                         traffic_pedestrians=2,
                         walker_ai=False, client_timeout=2.0, ready_timeout=30.0, bev_size=64, num_vehicles=6,
                         num_routes=16)
    try:
        obs = env.reset(seed=0)
        assert obs["bev"].shape == (1, 10, 64, 64) and obs["bev"].dtype == torch.uint8
        act = torch.tensor([[0.0, 0.6]])
        for _ in range(5):
            r = env.step(act)
            assert r.info["carla/crash"].item() == 0.0
        assert r.obs["measurements"][0, 4] > 0.5  # the ego drives
        os.killpg(env.server_pids[0], signal.SIGKILL)  # the server crashes mid-episode
        r = env.step(act)
        assert r.info["carla/crash"].item() == 1.0 and r.truncated.item() and r.info["done"].item()
        assert r.info["carla/restarts"].item() == 1.0
        assert r.obs["measurements"][0, 4] == 0.0  # the next episode started
        for _ in range(3):
            r = env.step(act)
        assert r.info["carla/crash"].item() == 0.0 and r.info["carla/restarts"].item() == 1.0
        assert r.obs["measurements"][0, 4] > 0.0
    finally:
        env.close()


def test_route_file_for_a_town_the_server_lacks(tmp_path: Path) -> None:
    routes = tmp_path / "routes.xml"
    routes.write_text('<routes><route id="0" town="Town02"><waypoints><position x="1" y="2" z="0"/>'
                      '<position x="50" y="2" z="0"/></waypoints></route></routes>')
    with pytest.raises(CarlaError, match="has no town 'Town02'; it offers Town01"):
        make_carla_env(1, town="Town02", route_file=str(routes), executable=str(standin_executable(tmp_path, TOWN01)),
                       base_port=23900, log_dir=str(tmp_path / "logs"), traffic_vehicles=0, traffic_pedestrians=0,
                       ready_timeout=30.0)
    with pytest.raises(CarlaError, match="no routes for town 'Town01'"):
        make_carla_env(1, town="Town01", route_file=str(routes), executable=str(standin_executable(tmp_path, TOWN01)),
                       base_port=23900, log_dir=str(tmp_path / "logs"), ready_timeout=30.0, num_routes=16)


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="unknown key; CARLA keys: .*simulator keys"):
        make_carla_env(1, twon="Town01")
    with pytest.raises(ConfigError, match="client_timeout"):
        make_carla_env(1, client_timeout=0.0)


LIGHTS = """
    import json, sys, torch, carla
    from envs.carla.config import split_options
    from envs.carla.worker import build_carla_env
    from envs.sim.expert import Expert
    rpc, tm = int(sys.argv[1]), int(sys.argv[2])
    cc, sc = split_options(dict(town="Town01", traffic_vehicles=0, traffic_pedestrians=0, traffic=False,
                                bev_size=64, route_split="eval", num_routes=16))
    w = build_carla_env(cc, sc, rpc, tm, seed=0)
    expert = Expert(w)
    tls = list(w.data.cworld.get_actors().filter("traffic.traffic_light*"))
    def set_all(colour):
        for tl in tls:
            tl.set_state(colour)
            tl.freeze(True)
    groups = w.world.stop_group.unsqueeze(0)
    states = lambda: sorted(set(w.lights.state(w.state, groups)[0][groups >= 0].tolist()))
    ch5 = lambda obs: sorted(set(obs["bev"][0, 5].unique().tolist()) - {0})
    set_all(carla.TrafficLightState.Green)
    obs = w.reset(seed=0)
    out = {"lights": len(tls), "groups": int(w.world.group_junction.shape[0]),
           "matched": w.data.lights.matched, "state": {"green": states()}}
    steps = 0
    while not ch5(obs) and steps < 600:  # the expert drives (on green) until a light is in view
        obs = w.step(expert(obs)).obs
        steps += 1
    out["steps_to_light"], out["ch5"] = steps, {"green": ch5(obs)}
    for name, colour in (("yellow", carla.TrafficLightState.Yellow), ("red", carla.TrafficLightState.Red)):
        set_all(colour)
        obs = w.step(expert(obs)).obs
        out["state"][name], out["ch5"][name] = states(), ch5(obs)
    out["red_light"] = 0.0
    for _ in range(150):  # through the red light at full throttle, steering like the expert
        a = expert(obs)
        a[:, 1] = 1.0
        r = w.step(a)
        obs = r.obs
        if bool(r.info["done"][0]):
            out["red_light"] = float(r.info["episode/infractions/red_light"][0])
            out["termination"] = [k for k, v in r.info.items() if k.startswith("episode/termination/") and float(v[0])]
            break
    w.close()
    print(json.dumps(out))
"""


def test_traffic_lights_set_on_the_server_reach_the_observation(standin) -> None:
    """The stand-in serves one light per signalised stop line; colours set through the client show in the light part,
    in BEV channel 5 and in the red-light check."""
    from envs.sim.observation import LIGHT_GREEN, LIGHT_RED

    r = run_script(LIGHTS, str(standin.ports.rpc), str(standin.ports.tm))
    assert r["lights"] > 0 and r["matched"] == r["groups"], r
    assert r["state"] == {"green": [0], "yellow": [1], "red": [2]}, r
    assert r["ch5"]["green"] == [LIGHT_GREEN] and r["ch5"]["red"] == [LIGHT_RED], r
    assert len(r["ch5"]["yellow"]) == 1 and LIGHT_GREEN < r["ch5"]["yellow"][0] <= LIGHT_RED, r
    assert r["red_light"] == 1.0 and r["termination"] == ["episode/termination/red_light"], r


VEHICLE_LIGHTS = """
    import json, sys, torch
    from envs.carla.config import split_options
    from envs.carla.worker import actor_half, build_carla_env
    from envs.maps.opendrive import carla_to_world
    from envs.sim.agents import LIGHT_BRAKE
    rpc, tm = int(sys.argv[1]), int(sys.argv[2])
    cc, sc = split_options(dict(town="Town01", traffic_vehicles=1, traffic_pedestrians=0, bev_size=32, bev_ppm=1.0,
                                bev_ego_from_bottom=12, route_split="eval", num_routes=8, num_vehicles=4))
    w = build_carla_env(cc, sc, rpc, tm, seed=0)
    w.reset(seed=0)
    # a Traffic Manager car 25 m behind the standing ego, lights managed by the TM as the worker's own traffic
    tf = w.data.cmap.get_waypoint(w.actors.tracked.ego.get_location()).previous(25.0)[0].transform
    tf.location.z += 0.5
    follower = w.data.cworld.spawn_actor(w.data.cworld.get_blueprint_library().find("vehicle.audi.a2"), tf)
    follower.set_autopilot(True, w.data.tm_port)
    w.data.tm.update_vehicle_lights(follower, True)
    w.actors.tracked.vehicles.append(follower)
    w.actors.tracked.half[follower.id] = actor_half(follower)
    out = {"same_as_server": True, "braking_lit": 0, "braking_dark": 0, "lit_rows": 0}
    speed = 0.0
    for _ in range(60):
        w.step(torch.tensor([[0.0, -1.0]]))  # the ego brakes, standing
        veh, flags = w.state.veh, w.data.cworld.get_vehicles_light_states()
        for v in w.actors.tracked.vehicles:  # the row of each CARLA vehicle, by position
            loc = v.get_location()
            xy = torch.tensor(carla_to_world(loc.x, loc.y), dtype=torch.float32)
            row = int(((veh.xy[0] - xy).norm(dim=-1) + (~veh.valid[0]) * 1e9).argmin())
            lit = bool(int(veh.lights[0, row]) & LIGHT_BRAKE)
            out["same_as_server"] &= lit == bool(int(flags.get(v.id, 0)) & 8)  # carla.VehicleLightState.Brake
        v_now = follower.get_velocity().length()
        if v_now < speed - 0.3 and speed > 1.0 and follower.get_control().brake > 0.5:  # braking hard while moving
            loc = follower.get_location()
            xy = torch.tensor(carla_to_world(loc.x, loc.y), dtype=torch.float32)
            row = int(((veh.xy[0] - xy).norm(dim=-1) + (~veh.valid[0]) * 1e9).argmin())
            out["braking_lit" if int(veh.lights[0, row]) & LIGHT_BRAKE else "braking_dark"] += 1
        speed = v_now
        out["lit_rows"] = max(out["lit_rows"], int(((veh.lights[0] & LIGHT_BRAKE) > 0).sum()))
    out["dtype"] = str(w.state.veh.lights.dtype)
    w.close()
    print(json.dumps(out))
"""


def test_braking_background_vehicle_shows_its_brake_light(standin) -> None:
    """A Traffic Manager car runs up behind the standing ego and brakes hard: the TM switches its brake light on
    (``update_vehicle_lights``), the stand-in keeps the light state as CARLA does, and the worker's one-RPC-per-tick
    read (``get_vehicles_light_states``) puts ``LIGHT_BRAKE`` into that car's row of ``s.veh.lights``."""
    r = run_script(VEHICLE_LIGHTS, str(standin.ports.rpc), str(standin.ports.tm))
    assert r["same_as_server"], r  # every vehicle, every tick: our bit == CARLA's Brake flag
    assert r["braking_lit"] >= 3 and r["lit_rows"] >= 1, r
    assert r["braking_dark"] <= 1, r  # the TM's light command may trail its first hard-brake control by one tick
    assert r["dtype"] == "torch.int32"


SCENARIOS = """
    import json, sys, torch, carla
    from envs.carla.config import split_options
    from envs.carla.worker import build_carla_env
    from envs.maps.opendrive import world_to_carla, world_yaw_to_carla
    from envs.sim.scenario_world import DOC, RIGHT
    rpc, tm, routes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    cc, sc = split_options(dict(town="Town01", traffic_vehicles=0, traffic_pedestrians=0, bev_size=32, bev_ppm=1.0,
                                bev_ego_from_bottom=10, route_file=routes, rules="leaderboard", first_route=0))
    w = build_carla_env(cc, sc, rpc, tm, seed=0)
    w.reset(seed=0)
    s, tab = w.state, w.world.scn
    row = tab.route_scn[int(s.route_id[0])]
    out = {}

    def go_to(kind):
        g = int(next(int(x) for x in row if x >= 0 and int(tab.type[x]) == kind))
        k = int(tab.act_first[g])
        xy = w.world.route_pts[int(s.route_id[0]), k]
        d = w.world.route_pts[int(s.route_id[0]), k + 1] - xy
        x, y = world_to_carla(float(xy[0]), float(xy[1]))
        yaw = float(world_yaw_to_carla(float(torch.atan2(d[1], d[0]))))
        w.actors.tracked.ego.set_transform(carla.Transform(carla.Location(x=x, y=y, z=0.5), carla.Rotation(yaw=yaw)))
        w.state.route_idx[0] = w.state.crit.dev_idx[0] = k
        return g

    def server(prefix):
        return [(a.type_id, a.get_transform()) for a in w.data.cworld.get_actors() if a.type_id.startswith(prefix)]

    go_to(DOC)
    for _ in range(3):
        w.step(torch.tensor([[0.0, -1.0]]))
    s = w.state
    walkers, props = server("walker."), server("static.prop.")
    p0, o0 = w.scenarios.ped0, w.scenarios.sta0
    out["walkers"] = [[t.location.x, -t.location.y] for _, t in walkers]
    out["props"] = [[t.location.x, -t.location.y] for _, t in props]
    out["state_walker"] = s.ped.xy[0, p0].tolist() if bool(s.ped.valid[0, p0]) else None
    out["state_prop"] = s.statics.xy[0, o0].tolist() if bool(s.statics.valid[0, o0]) else None
    g = go_to(RIGHT)
    for _ in range(2):  # the cars spawned after one tick are in the world's actor list after the next
        w.step(torch.tensor([[0.0, -1.0]]))
    ego_group = int(tab.light_ego[g])
    light = w.data.lights.actors[int(w.data.lights.group_light[ego_group])]
    out["ego_light_red"] = str(light.get_state())
    out["flow_cars"] = len(server("vehicle.")) - 1  # the ego is a vehicle too
    out["state_flow_cars"] = int(w.state.veh.valid[0, w.scenarios.veh0:w.scenarios.veh0 + 8].sum())
    for _ in range(60):
        w.step(torch.tensor([[0.0, -1.0]]))
    out["ego_light_after_5s"] = str(w.data.lights.actors[int(w.data.lights.group_light[ego_group])].get_state())
    w.close()
    print(json.dumps(out))
"""


def test_route_scenarios_play_on_the_server(standin) -> None:
    """longest6 route 0 (Town01) with its scenarios through the real client: the pedestrian and its blocker of a
    DynamicObjectCrossing stand on the server where the state has them; a right turn's flow cars are server
    vehicles, and the ego's light is held red for 5 s, then green."""
    routes = "/work/shared/data/carla/routes/longest6_v2.xml"
    if not Path(routes).is_file():
        pytest.skip("longest6 route file not available")
    r = run_script(SCENARIOS, str(standin.ports.rpc), str(standin.ports.tm), routes, timeout=300)
    assert r["state_walker"] is not None and r["state_prop"] is not None
    assert any(abs(x - r["state_walker"][0]) < 0.05 and abs(y - r["state_walker"][1]) < 0.05 for x, y in r["walkers"])
    assert any(abs(x - r["state_prop"][0]) < 0.05 and abs(y - r["state_prop"][1]) < 0.05 for x, y in r["props"])
    assert r["ego_light_red"] == "Red" and r["ego_light_after_5s"] == "Green"
    assert r["flow_cars"] == r["state_flow_cars"] >= 1


def test_a_blueprint_the_server_lacks_is_named_at_the_first_reset_not_counted_as_a_crash() -> None:
    """A server whose library has no blueprint for a scenario actor (here: none at all) cannot play the route
    scenarios however often it restarts: the part raises CarlaError naming the actor and the fix when it first
    mirrors the state (the episode's reset), instead of losing every episode as a server crash."""
    from envs.carla.scenarios import CarlaScenarios

    class Library:
        def filter(self, pattern: str) -> list:
            return []

    class Session:
        crashed = False

        def __init__(self) -> None:
            self.cworld = type("World", (), {"get_blueprint_library": lambda _self: Library()})()

        def mark_crash(self, e: BaseException) -> None:
            raise AssertionError(f"counted as a crash: {e}")

    part = CarlaScenarios(Session())
    part.on = True
    with pytest.raises(CarlaError, match=r"no blueprint for a scenario car \(none matches vehicle\.lincoln\.mkz_2020, "
                                         r"vehicle\.\*\).*env\.options\.route_scenarios=false"):
        part.mirror(None)
