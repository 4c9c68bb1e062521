"""Server manager: port blocks, command lines, CARLA_ROOT errors, readiness time-outs with log tails, restarts.

Stand-in executables replace ``CarlaUE4.sh``: shell scripts that never get ready or die, and the protocol stand-in
(``tests/support/carla_standin.py``), which the real ``carla`` client probes in a subprocess (marked ``carla``).
"""
from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from envs.carla.servers import (CarlaServer, PortAllocator, PortBlock, ServerError, ServerManager, launch_command,
                                port_free, resolve_executable)
from envs.maps.opendrive import default_maps_dir
from tests.support.processes import standin_executable, write_script

MAPS = default_maps_dir()
TOWN01 = MAPS / "Town01.xodr" if MAPS else None
needs_town = pytest.mark.skipif(TOWN01 is None or not TOWN01.is_file(), reason="CARLA town maps not available")


def test_port_blocks_are_disjoint_and_skip_busy_ports() -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        alloc = PortAllocator(base=port - 1, stride=4)  # the first block [port-1, port+2] contains the busy port
        blocks = alloc.allocate_many(3)
        ports = [p for b in blocks for p in b.ports()]
        assert len(set(ports)) == len(ports) == 12
        assert port not in ports
        assert all(b.streaming == b.rpc + 1 and b.tm == b.rpc + 3 for b in blocks)
        alloc.release(blocks[1])
        assert alloc.allocate() == blocks[1]  # a released block is reused, and only then
    finally:
        busy.close()
    assert port_free(port)


def test_bad_port_settings() -> None:
    with pytest.raises(ServerError, match="overlap"):
        PortAllocator(stride=2)
    with pytest.raises(ServerError, match="1024"):
        PortAllocator(base=80)


def test_launch_command_line() -> None:
    cmd = launch_command("/opt/carla/CarlaUE4.sh", PortBlock.at(2010), gpu=3, no_rendering=True,
                         extra_args=("-quality-level=Low",))
    assert cmd == ["/opt/carla/CarlaUE4.sh", "-RenderOffScreen", "-nosound", "-carla-rpc-port=2010",
                   "-carla-streaming-port=2011", "-carla-primary-port=2012", "-graphicsadapter=3", "-nullrhi",
                   "-quality-level=Low"]
    assert "-graphicsadapter" not in " ".join(launch_command("x", PortBlock.at(2000)))


def test_carla_root_missing_or_wrong(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CARLA_ROOT", raising=False)
    with pytest.raises(ServerError, match="CARLA_ROOT is not set"):
        resolve_executable(None)
    monkeypatch.setenv("CARLA_ROOT", str(tmp_path))
    with pytest.raises(ServerError, match="has no CarlaUE4.sh"):
        resolve_executable(None)
    with pytest.raises(ServerError, match="does not exist"):
        resolve_executable(tmp_path / "nope.sh")
    exe = write_script(tmp_path / "CarlaUE4.sh", "exit 0")
    assert resolve_executable(None) == exe


def test_readiness_timeout_reports_log_tail_and_kills(tmp_path: Path) -> None:
    exe = write_script(tmp_path / "CarlaUE4.sh", 'echo "LowLevelFatalError: out of video memory $*"; exec sleep 60')
    server = CarlaServer(exe, PortAllocator(base=23000).allocate(), tmp_path / "logs", ready_timeout=2.0)
    server.start()
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="not ready after 2 s") as e:
        server.wait_ready()
    assert time.monotonic() - t0 < 15.0  # bounded wait, never a hang
    assert "out of video memory" in str(e.value) and "-carla-rpc-port=" in str(e.value)
    assert not server.alive()  # the whole process group was killed


def test_server_that_exits_reports_log_tail(tmp_path: Path) -> None:
    exe = write_script(tmp_path / "CarlaUE4.sh", 'echo "Signal 11 caught."; exit 3')
    server = CarlaServer(exe, PortAllocator(base=23100).allocate(), tmp_path / "logs", ready_timeout=20.0)
    server.start()
    with pytest.raises(ServerError, match=r"exited \(code 3\)") as e:
        server.wait_ready()
    assert "Signal 11 caught." in str(e.value)


@pytest.mark.carla
@needs_town
def test_standin_server_ready_health_and_restart(tmp_path: Path) -> None:
    exe = standin_executable(tmp_path, TOWN01)
    with ServerManager(2, executable=exe, log_dir=tmp_path / "logs", base_port=23200, ready_timeout=30.0) as m:
        assert m.start_all() == ["0.9.16", "0.9.16"]
        a, b = m.servers
        assert set(a.ports.ports()).isdisjoint(b.ports.ports())
        assert m.check_health() == []
        os.killpg(a.proc.pid, signal.SIGKILL)  # a crash
        a.proc.wait()
        assert not a.healthy()
        assert m.check_health() == [0]
        assert a.restarts == 1 and m.restarts == 1 and a.healthy() and b.healthy()
    assert not a.alive() and not b.alive()


@pytest.mark.carla
@needs_town
def test_version_mismatch_is_an_error(tmp_path: Path) -> None:
    exe = standin_executable(tmp_path, TOWN01, extra=("--report-version", "0.9.15"))
    server = CarlaServer(exe, PortAllocator(base=23300).allocate(), tmp_path / "logs", ready_timeout=30.0)
    server.start()
    try:
        with pytest.raises(ServerError, match="version 0.9.15 but the client is 0.9.16"):
            server.wait_ready()
    finally:
        server.kill()
