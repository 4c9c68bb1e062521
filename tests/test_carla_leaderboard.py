"""The Leaderboard 2.0 agent without the leaderboard package: config parsing, plan conversion, and the agent driven
through the real ``carla`` client against the stand-in (the evaluator's role played by a small loop)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from envs.carla.servers import CarlaServer, PortAllocator
from envs.maps.opendrive import default_maps_dir
from tests.support.processes import standin_executable
from test_export import tiny_checkpoint  # one tiny trainer checkpoint for every test

MAPS = default_maps_dir()
TOWN01 = MAPS / "Town01.xodr" if MAPS else None
ROOT = Path(__file__).resolve().parents[1]
needs_maps = pytest.mark.skipif(TOWN01 is None or not TOWN01.is_file(), reason="CARLA town maps not available")


def test_agent_config_and_plan(tmp_path: Path) -> None:
    from carl.deploy.leaderboard_agent import keypoints_from_plan, read_agent_config, sim_config_for

    assert read_agent_config(tmp_path / "a.pt") == {"policy": str(tmp_path / "a.pt")}
    (tmp_path / "agent.json").write_text(json.dumps({"policy": "bundle", "options": {"light_yellow": 3.0}}))
    conf = read_agent_config(tmp_path / "agent.json")
    assert conf["policy"] == str(tmp_path / "bundle") and conf["options"] == {"light_yellow": 3.0}
    from carl import zoo

    assert read_agent_config("zoo:towns_vector") == {"policy": str(zoo.ZOO_DIR / "towns_vector")}
    (tmp_path / "zoo.yaml").write_text("policy: zoo:towns_vector\n")
    assert read_agent_config(tmp_path / "zoo.yaml")["policy"] == str(zoo.ZOO_DIR / "towns_vector")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="needs a 'policy'"):
        read_agent_config(tmp_path / "bad.json")
    cfg = sim_config_for({"bev_geometry": {"bev_size": 32, "bev_ppm": 1.0, "bev_ego_from_bottom": 10}},
                         {"light_yellow": 3.0})
    assert (cfg.bev_size, cfg.bev_ppm, cfg.bev_ego_from_bottom, cfg.light_yellow) == (32, 1.0, 10, 3.0)

    class T:  # carla.Transform's shape
        def __init__(self, x: float, y: float):
            self.location = type("L", (), {"x": x, "y": y})()

    kp = keypoints_from_plan([(T(1.0, 2.0), None), (T(3.0, -4.0), None)])
    np.testing.assert_allclose(kp, [[1.0, -2.0], [3.0, 4.0]])  # CARLA (x, y) -> ours (x, -y)



def test_vehicle_light_states_map_onto_the_simulator_bits() -> None:
    """carla.VehicleLightState flags -> LIGHT_* (CaRL's BEV encodings): brake, blinkers, and sirens only on emergency
    vehicles; position lights and beams are dropped. Rows follow the nearest-first order into ``veh.lights``."""
    from types import SimpleNamespace

    import torch

    from envs.carla.mapping import Reading, fill_vehicles, lights_from_carla, vehicle_lights
    from envs.sim.agents import LIGHT_BRAKE, LIGHT_EMERGENCY, LIGHT_LEFT_BLINKER, LIGHT_RIGHT_BLINKER

    flags = [0, 8 | 1 | 2, 32, 16, 512, 1024 | 8, 512]  # none, brake+position+low beam, left, right, siren, ...
    emergency = [False, False, False, False, True, True, False]
    got = lights_from_carla(flags, emergency)
    assert got.dtype == np.int32
    assert got.tolist() == [0, LIGHT_BRAKE, LIGHT_LEFT_BLINKER, LIGHT_RIGHT_BLINKER, LIGHT_EMERGENCY,
                            LIGHT_EMERGENCY | LIGHT_BRAKE, 0]
    assert vehicle_lights({7: 8, 9: 48}, [9, 5, 7]).tolist() == [LIGHT_LEFT_BLINKER | LIGHT_RIGHT_BLINKER, 0,
                                                                  LIGHT_BRAKE]
    r = Reading.from_carla(np.array([30.0, 10.0]), np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2),
                           np.ones((2, 2)), np.array([LIGHT_BRAKE, LIGHT_LEFT_BLINKER], np.int32))
    veh = SimpleNamespace(xy=torch.zeros(1, 3, 2))
    fill_vehicles(veh, r, torch.zeros(1, 2))  # nearest first: the car at x=10 (left blinker), then x=30 (brake)
    assert veh.lights.dtype == torch.int32 and veh.lights.tolist() == [[LIGHT_LEFT_BLINKER, LIGHT_BRAKE, 0]]
    assert veh.valid.tolist() == [[True, True, False]]
    assert Reading.empty().lights.shape == (0,)

DRIVE = """
    import faulthandler, json, sys, torch, carla
    faulthandler.dump_traceback_later(float(sys.argv[4]), exit=True)  # every thread's stack, should it ever hang
    from envs.carla.config import split_options
    from envs.carla.worker import build_carla_env
    from carl.deploy.leaderboard_agent import CarlAgent
    from envs.maps.opendrive import world_to_carla
    rpc, tm, ckpt, extra = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[5])
    cc, sc = split_options(dict(town="Town01", traffic_vehicles=2, traffic_pedestrians=2, walker_ai=False,
                                bev_size=32, bev_ppm=1.0, bev_ego_from_bottom=10, route_split="eval", num_routes=16,
                                num_vehicles=8, num_pedestrians=4, **extra))
    w = build_carla_env(cc, sc, rpc, tm, seed=0)  # spawns the hero at route 0's start and traffic, like the evaluator
    world = w.data.cworld
    # the leaderboard's 20 Hz, set before the episode: carla's apply_settings ticks the world until two snapshots
    # carry the new delta (2 ticks here, more on a loaded machine), which would move the traffic after ``ref``
    s = world.get_settings(); s.fixed_delta_seconds = 0.05; world.apply_settings(s)
    ref = w.reset(seed=0)
    frame = world.get_snapshot().frame  # the frame the worker read
    rid = int(w.state.route_id[0]); n = int(w.world.route_n[rid])
    pts = w.world.route_pts[rid, :n].numpy()
    keep = list(range(0, n, 25)) + [n - 1]
    plan = [(carla.Transform(carla.Location(*world_to_carla(float(pts[i, 0]), float(pts[i, 1])), 0.0)), None)
            for i in keep]
    agent = CarlAgent("127.0.0.1", rpc)
    agent.set_global_plan(None, plan)
    agent.world = w.data.cworld  # the evaluator's world (CarlaDataProvider.get_world() under the leaderboard)
    agent.setup(ckpt)
    hero = w.actors.tracked.ego
    c0 = agent.run_step({}, 0.0)
    obs0 = agent.last_obs
    out = {"control": type(c0).__name__, "keys": sorted(obs0),
           "bev_diff_frac": float((obs0["bev"] != ref["bev"]).float().mean()) if "bev" in ref else 0.0,
           "obs_diff": {k: float((obs0[k].float() - ref[k].float()).abs().max()) for k in ref},
           "meas_diff": float((obs0["measurements"] - ref["measurements"]).abs().max()),
           "ped_valid": int(agent.mirror.state.ped.valid.sum()), "veh_valid": int(agent.mirror.state.veh.valid.sum()),
           "lights_matched": agent.mirror.light_src.matched, "ticks_before_agent": world.get_snapshot().frame - frame}
    acts, t = 1, 0.0
    for k in range(40):
        world.tick(); t += 0.05
        before = agent.last_obs
        c = agent.run_step({}, t)
        acts += agent.last_obs is not before
        hero.apply_control(c)
        assert all(map(lambda v: v == v, (c.throttle, c.steer, c.brake)))
    out["actions"] = acts
    out["steps"] = int(agent.mirror.state.steps[0]); out["t"] = float(agent.mirror.state.t[0])
    agent.destroy(); w.close()
    print(json.dumps(out))
"""


def _drive(tmp_path: Path, ckpt: Path, extra: dict, port: int) -> dict:
    """The agent's run on the stand-in server beside the env worker (the DRIVE script); its result line."""
    srv = CarlaServer(standin_executable(tmp_path, TOWN01, MAPS), PortAllocator(base=port).allocate(), tmp_path,
                      ready_timeout=30)
    srv.start()
    try:
        srv.wait_ready()
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(DRIVE), str(srv.ports.rpc), str(srv.ports.tm),
                               str(ckpt), "150", json.dumps(extra)], capture_output=True, text=True,
                              timeout=180, cwd=ROOT)
    finally:
        srv.kill()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.carla
@needs_maps
def test_agent_with_a_vector_policy_sees_what_the_env_worker_sees(tmp_path: Path) -> None:
    """A set-policy checkpoint: the agent mirrors CARLA into the vector observation at the policy's sizes, equal to
    the env worker's (built with the same sizes) on the same route, and drives at 10 Hz."""
    from test_set_policy import COUNTS, tiny_set_checkpoint

    from carl.bundle import load_policy

    ckpt = tiny_set_checkpoint(tmp_path / "set.pt")
    geometry = load_policy(ckpt)[1]["vector_geometry"]
    r = _drive(tmp_path, ckpt, {"observation": "vector", "bev": False, "vector": geometry}, 24800)
    assert "bev" not in r["keys"] and "lanes" in r["keys"], r
    # the agent reads the frame the worker read (no tick between them), from the client's actors rather than the
    # worker's snapshot: the same vehicles in the same rows with the same poses, sizes and lights; the route is
    # re-planned from the sparse plan (float rounding)
    assert r["ticks_before_agent"] == 0, r
    assert max(r["obs_diff"].values()) < 1e-4, r
    assert r["actions"] == 21 and r["steps"] == 20 and r["veh_valid"] == 2, r
    assert COUNTS["vehicles"] == geometry["vehicles"]


@pytest.mark.carla
@needs_maps
def test_agent_drives_through_the_real_client(tmp_path: Path) -> None:
    r = _drive(tmp_path, tiny_checkpoint(tmp_path / "tiny.pt"), {}, 24700)
    assert r["control"] == "VehicleControl"
    assert r["actions"] == 21 and r["steps"] == 20 and abs(r["t"] - 2.0) < 1e-5  # 10 Hz policy on a 20 Hz world
    # the agent's first observation is the env worker's on the same route (the route re-planned from the sparse
    # global plan, the same conversion of CARLA's actors and lights, the same rasteriser): bitwise
    assert r["bev_diff_frac"] == 0.0 and r["meas_diff"] == 0.0, r
    assert r["veh_valid"] == 2 and r["lights_matched"] > 0, r
