"""CI bar of issue 5: ``carl-train env=carla`` through the real ``carla`` client against the stand-in, with the
stand-in killed mid-training. The trainer runs in a subprocess; the test kills the server's process group (pid from
``log_dir/carla_<port>.pid``) once the first update's checkpoint exists."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from envs.maps.opendrive import default_maps_dir
from tests.support.processes import standin_executable

MAPS = default_maps_dir()
TOWN01 = MAPS / "Town01.xodr" if MAPS else None
ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.carla,
              pytest.mark.skipif(TOWN01 is None or not TOWN01.is_file(), reason="CARLA town maps not available")]
UPDATES = 6


def _scalars(tb_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.endswith(tag)]  # the logger may rename episode/x to charts/episode_x
    return [e.value for t in tags for e in acc.Scalars(t)]


def test_train_survives_a_killed_server(tmp_path: Path) -> None:
    run, logs = tmp_path / "run", tmp_path / "logs"
    cmd = [sys.executable, "-m", "carl.train", "env=carla", "env.num_envs=1",
           f"++env.options.executable={standin_executable(tmp_path, TOWN01)}", "++env.options.base_port=24300",
           f"++env.options.log_dir={logs}", "++env.options.bev_size=32", "++env.options.bev_ppm=1.0",
           "++env.options.bev_ego_from_bottom=12", "++env.options.traffic_vehicles=0",
           "++env.options.traffic_pedestrians=2", "++env.options.walker_ai=false", "++env.options.num_routes=8",
           "++env.options.ready_timeout=30", "++env.options.client_timeout=2",
           "ppo.num_steps=32", "ppo.minibatch_size=16", "ppo.update_epochs=1", f"ppo.total_timesteps={32 * UPDATES}",
           "logging.eval_episodes=0", "logging.final_baselines=false", "logging.progress_bar=false",
           f"run_dir={run}", "parallel.torch_threads=1"]
    killed: dict[str, int] = {}

    def killer(proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            pids = sorted(logs.glob("carla_*.pid"))
            if (run / "last.pt").exists() and pids:
                pid = int(pids[0].read_text())
                try:
                    os.killpg(pid, signal.SIGKILL)
                    killed["pid"] = pid
                except ProcessLookupError:
                    pass
                return
            time.sleep(0.02)

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    t = threading.Thread(target=killer, args=(proc,), daemon=True)
    t.start()
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for f in logs.glob("carla_*.pid"):  # never leak a server
            try:
                os.killpg(int(f.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    print("\n".join(line for line in out.splitlines() if line.startswith("update ")))  # figures, with pytest -s
    assert proc.returncode == 0, out[-4000:]
    assert "pid" in killed, "the server was never killed: " + out[-2000:]
    assert f"update {UPDATES}/{UPDATES}" in out, out[-3000:]  # every update ran
    assert "restart #1" in out, out[-3000:]  # the worker logged the restart
    assert int((logs / next(logs.glob("carla_*.pid")).name).read_text()) != killed["pid"]  # a new server runs
    assert max(_scalars(run / "tb", "carla_restarts")) >= 1.0  # counted in the logged episode stats
    assert max(_scalars(run / "tb", "carla_crash")) > 0.0
