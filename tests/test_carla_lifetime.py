"""No process left behind (issue #11, part 6): every server and worker a CARLA env starts is gone after a normal
close, an exception, SIGTERM / SIGINT of its owner, a SIGKILLed owner and a SIGKILLed worker.

Each test gives the processes it starts their own environment tag (``CARL_PROCESS_TAG``), inherited by workers,
launchers and stand-in servers, so survivors are found even after they were re-parented to init. Owners that get
signals run in subprocesses. The real ``carla`` client talks to the protocol stand-in throughout (marked ``carla``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from envs.carla.vector import make_carla_env
from envs.maps.opendrive import default_maps_dir
from tests.support.processes import (TAG_VAR, Proc, describe, is_helper, processes, standin_executable, tagged,
                                     wait_for, write_script)

MAPS = default_maps_dir()
TOWN01 = MAPS / "Town01.xodr" if MAPS else None
ROOT = Path(__file__).resolve().parents[1]
needs_town = pytest.mark.skipif(TOWN01 is None or not TOWN01.is_file(), reason="CARLA town maps not available")
GONE_WITHIN_S = 8.0  # a stopped server gets 2-5 s between SIGTERM and SIGKILL; the watchdogs poll every 0.2 s


@pytest.fixture
def tag(monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh process tag for everything this test starts."""
    value = f"lifetime-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv(TAG_VAR, value)
    return value


def left(tag: str) -> dict[int, Proc]:
    """Living processes carrying ``tag`` (multiprocessing's helper processes aside)."""
    table = processes()
    return {pid: table[pid] for pid in tagged(tag, table) if not is_helper(table[pid])}


def assert_nothing_left(tag: str, timeout: float = GONE_WITHIN_S) -> None:
    rest = wait_for(lambda: left(tag), timeout)
    assert not rest, f"processes outlived their owner:\n{describe(rest)}"


def options(tmp_path: Path, port: int) -> dict:
    return dict(town="Town01", executable=str(standin_executable(tmp_path, TOWN01)), base_port=port,
                log_dir=str(tmp_path / "logs"), traffic_vehicles=0, traffic_pedestrians=0, ready_timeout=30.0,
                client_timeout=5.0, bev_size=32, bev_ppm=1.0, bev_ego_from_bottom=12, num_routes=8, num_vehicles=4)


def standins(tag: str) -> dict[int, Proc]:
    return {pid: p for pid, p in left(tag).items() if "carla_standin.py" in p.cmdline}


# ---------------------------------------------------------------------------------------------- in this process
@pytest.mark.carla
@needs_town
def test_normal_close_leaves_nothing(tmp_path: Path, tag: str) -> None:
    env = make_carla_env(1, "cpu", seed=0, **options(tmp_path, 25300))
    try:
        env.reset(seed=0)
        env.step(torch.tensor([[0.0, 0.5]]))
        running = left(tag)
        assert standins(tag) and any("launcher.py" in p.cmdline for p in running.values()), describe(running)
        assert env.procs[0].pid in running
    finally:
        env.close()
    assert_nothing_left(tag, timeout=1.0)  # close() returns only once everything is gone


@pytest.mark.carla
@needs_town
def test_exception_inside_with_leaves_nothing(tmp_path: Path, tag: str) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with make_carla_env(1, "cpu", seed=0, **options(tmp_path, 25320)) as env:
            env.reset(seed=0)
            assert standins(tag)
            raise RuntimeError("boom")
    assert_nothing_left(tag, timeout=1.0)


@pytest.mark.carla
@needs_town
def test_killed_worker_takes_its_server_along(tmp_path: Path, tag: str) -> None:
    """SIGKILL of a worker process: its server's launcher notices and stops the server; the env replaces the worker
    on the next step and ``close()`` leaves nothing."""
    env = make_carla_env(1, "cpu", seed=0, **options(tmp_path, 25340))
    try:
        env.reset(seed=0)
        old_server = set(standins(tag))
        assert old_server
        os.kill(env.procs[0].pid, signal.SIGKILL)
        gone = wait_for(lambda: {pid: p for pid, p in left(tag).items() if pid in old_server}, GONE_WITHIN_S)
        assert not gone, f"the stand-in outlived its worker:\n{describe(gone)}"
        r = env.step(torch.tensor([[0.0, 0.5]]))  # the env notices the dead worker and starts a new one
        assert r.info["carla/process_restarts"][0].item() == 1.0 and r.truncated[0].item()
        assert standins(tag) and not set(standins(tag)) & old_server
    finally:
        env.close()
    assert_nothing_left(tag, timeout=1.0)


# ---------------------------------------------------------------------------------------------- owner processes
OWNER = """
    import faulthandler, json, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that waits in vain asks for every stack
    # Ctrl-C as in a terminal: Python turns SIGINT into KeyboardInterrupt only where it was not ignored at start,
    # and a test run started in the background (nohup, `make test &`, some CI runners) hands SIG_IGN down
    signal.signal(signal.SIGINT, signal.default_int_handler)
    kind, opts = sys.argv[1], json.loads(sys.argv[2])
    if kind == "env":
        from envs.carla.vector import make_carla_env
        env = make_carla_env(1, "cpu", seed=0, **opts)
        env.reset(seed=0)
        info = {"workers": [p.pid for p in env.procs], "servers": env.server_pids}
    else:  # a bare server, as a test fixture or carl-eval's server manager would hold it
        from pathlib import Path
        from envs.carla.servers import CarlaServer, PortAllocator
        srv = CarlaServer(Path(opts["executable"]), PortAllocator(base=opts["base_port"]).allocate(),
                          Path(opts["log_dir"]), ready_timeout=30.0)
        srv.start()
        if kind == "server":
            srv.wait_ready()
        info = {"workers": [], "servers": [srv.proc.pid]}
    print("READY " + json.dumps(info), flush=True)
    time.sleep(300)
"""


def start_owner(kind: str, opts: dict, timeout: float = 60.0) -> tuple[subprocess.Popen, dict]:
    """Run :data:`OWNER` and wait until it holds its servers; returns the process and what it reported."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(OWNER), kind, json.dumps(opts)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("READY "):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout) or not any(x.startswith("READY ") for x in lines):
        proc.kill()
        proc.wait()
        raise AssertionError("owner did not get ready:\n" + "".join(lines)[-3000:])
    info = json.loads(next(x for x in lines if x.startswith("READY "))[6:])
    info["output"] = lines  # what the owner writes from now on lands here too
    return proc, info


@pytest.mark.carla
@needs_town
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_signal_to_the_owner_of_an_env_leaves_nothing(tmp_path: Path, tag: str, sig: signal.Signals) -> None:
    """SIGTERM: the env's handler stops workers and servers, then the process dies of SIGTERM. SIGINT: the
    KeyboardInterrupt ends the interpreter, whose ``atexit`` hook closes the env."""
    proc, info = start_owner("env", options(tmp_path, 25360))
    lines = info["output"]
    try:
        assert standins(tag) and info["workers"]
        t0 = time.monotonic()
        os.kill(proc.pid, sig)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # the owner's stacks, then the stuck processes' census
            time.sleep(2.0)
            raise AssertionError(f"owner still running 30 s after {sig.name}; its output and stacks:\n"
                                 + "".join(lines)[-6000:] + "\n" + describe(left(tag))) from None
        assert code != 0
        if sig == signal.SIGTERM:
            assert code == -signal.SIGTERM  # still ends as SIGTERM's default would
        assert_nothing_left(tag)
        assert time.monotonic() - t0 < 20.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.carla
@needs_town
@pytest.mark.parametrize("kind", ["env", "server"])
def test_sigkilled_owner_leaves_nothing(tmp_path: Path, tag: str, kind: str) -> None:
    """SIGKILL of the owner runs no clean-up code at all: the workers' parent watch and the launchers' watchdogs
    (PR_SET_PDEATHSIG + getppid) take the servers down within a few seconds."""
    proc, info = start_owner(kind, options(tmp_path, 25380 if kind == "env" else 25400))
    assert standins(tag)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    t0 = time.monotonic()
    assert_nothing_left(tag)
    assert time.monotonic() - t0 < 5.0


# ---------------------------------------------------------------------------------------------- no carla client
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_owner_death_takes_down_a_forking_launcher_script(tmp_path: Path, tag: str, sig: signal.Signals) -> None:
    """Like ``CarlaUE4.sh``, the fake server script forks its real process without ``exec``: the death signal alone
    would kill only the shell; the launcher takes down the whole group."""
    exe = write_script(tmp_path / "CarlaUE4.sh", "sleep 300\necho done")
    opts = {"executable": str(exe), "base_port": 25420, "log_dir": str(tmp_path / "logs")}
    proc, info = start_owner("server-unready", opts)
    try:
        not_yet = wait_for(lambda: {} if any(p.cmdline.startswith("sleep 300") for p in left(tag).values())
                           else left(tag), 10.0)  # the launcher -> sh -> sleep chain is up
        assert not not_yet, describe(not_yet)
        os.kill(proc.pid, sig)
        proc.wait(timeout=20)
        assert_nothing_left(tag, timeout=5.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
