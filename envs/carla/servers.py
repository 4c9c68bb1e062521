"""CARLA server management: port blocks, launch command lines, readiness probes, health checks, kill and restart.

One :class:`CarlaServer` is one ``CarlaUE4.sh`` process (its own process group, so the shell script and the
``CarlaUE4-Linux-Shipping`` child die together) on a disjoint :class:`PortBlock`. :class:`ServerManager` owns N of
them. Nothing here imports ``carla``: readiness is probed by a fresh client in a subprocess (:func:`probe_version`),
because a misbehaving server can abort the client process (``std::terminate``), and because an old ``carla.Client``
never reconnects after a restart.

Errors are :class:`ServerError` with the cause and the fix (missing ``CARLA_ROOT``, a server that never becomes
ready -- with the tail of its log --, a version mismatch, no free ports).
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

CLIENT_VERSION = "0.9.16"  # the pinned ``carla`` client the workers and the stand-in speak
PORT_STRIDE = 4  # ports per block: rpc, streaming (= rpc + 1), primary (rpc + 2), traffic manager (rpc + 3)
LOG_TAIL_LINES = 30


class ServerError(RuntimeError):
    """A CARLA server could not be found, started, reached or kept alive; the message says why and what to do."""


# ---------------------------------------------------------------------------------------------- ports
@dataclass(frozen=True)
class PortBlock:
    """The ports one server (and its client-side Traffic Manager) uses. All passed explicitly: CARLA's defaults
    (streaming = rpc + 1, primary = 2002, TM = 8000) collide as soon as two servers share a node."""

    rpc: int
    streaming: int
    primary: int
    tm: int

    @classmethod
    def at(cls, base: int) -> "PortBlock":
        return cls(rpc=base, streaming=base + 1, primary=base + 2, tm=base + 3)

    def ports(self) -> tuple[int, ...]:
        return (self.rpc, self.streaming, self.primary, self.tm)


def port_free(port: int, host: str = "127.0.0.1", reuse: bool = False) -> bool:
    """True when nothing listens on ``port`` and it can be bound (bind test plus connect test).

    ``reuse``: bind with ``SO_REUSEADDR``, as CARLA's (boost.asio) and the stand-in's listeners do, so connections of
    a killed server lingering in TIME_WAIT do not count; used when restarting a server on its own ports."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        if s.connect_ex((host, port)) == 0:
            return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if host in ("127.0.0.1", "localhost") else host, port))
        except OSError:
            return False
    return True


class PortAllocator:
    """Hands out disjoint :class:`PortBlock` s, scanning upward from ``base`` in steps of ``stride``.

    A block is handed out only if all its ports pass :func:`port_free` and no block handed out by this allocator
    overlaps it; :meth:`release` returns a block once its server is gone.
    """

    def __init__(self, base: int = 2000, stride: int = PORT_STRIDE, limit: int = 65000, host: str = "127.0.0.1"):
        if stride < PORT_STRIDE:
            raise ServerError(f"port stride {stride} < {PORT_STRIDE}: blocks (rpc, streaming, primary, tm) would overlap")
        if not 1024 <= base < limit <= 65535:
            raise ServerError(f"port range [{base}, {limit}) must lie within [1024, 65535]")
        self.base, self.stride, self.limit, self.host = base, stride, limit, host
        self._taken: set[int] = set()

    def allocate(self) -> PortBlock:
        for start in range(self.base, self.limit - PORT_STRIDE, self.stride):
            block = PortBlock.at(start)
            if any(p in self._taken for p in block.ports()):
                continue
            if all(port_free(p, self.host) for p in block.ports()):
                self._taken.update(block.ports())
                return block
        raise ServerError(f"no free block of {PORT_STRIDE} ports in [{self.base}, {self.limit}); free ports or "
                          "choose another carla base_port")

    def allocate_many(self, n: int) -> list[PortBlock]:
        return [self.allocate() for _ in range(n)]

    def release(self, block: PortBlock) -> None:
        self._taken.difference_update(block.ports())


# ---------------------------------------------------------------------------------------------- launch
def resolve_executable(executable: str | os.PathLike | None = None) -> Path:
    """The server launcher: ``executable`` if given, else ``$CARLA_ROOT/CarlaUE4.sh``. Raises :class:`ServerError`."""
    if executable:
        path = Path(executable).expanduser()
        if not path.is_file():
            raise ServerError(f"CARLA executable {path} does not exist; set env.options.executable to CarlaUE4.sh "
                              "of an installed CARLA 0.9.16 server")
    else:
        root = os.environ.get("CARLA_ROOT")
        if not root:
            raise ServerError("CARLA_ROOT is not set: export CARLA_ROOT=/path/to/CARLA_0.9.16 (the folder holding "
                              "CarlaUE4.sh) or set env.options.executable; see docs/carla.md")
        path = Path(root).expanduser() / "CarlaUE4.sh"
        if not path.is_file():
            raise ServerError(f"CARLA_ROOT={root} has no CarlaUE4.sh; point CARLA_ROOT at the unpacked CARLA 0.9.16 "
                              "release folder (see docs/carla.md)")
    if not os.access(path, os.X_OK):
        raise ServerError(f"CARLA executable {path} is not executable (chmod +x it)")
    return path


def launch_command(executable: str | os.PathLike, ports: PortBlock, gpu: int | None = None,
                   no_rendering: bool = False, extra_args: Sequence[str] = ()) -> list[str]:
    """The ``CarlaUE4.sh`` command line for one server.

    ``gpu`` is the *Vulkan* adapter index (``-graphicsadapter``); ``no_rendering`` adds ``-nullrhi`` (no GPU at all,
    enough for BEV-only training).
    """
    cmd = [str(executable), "-RenderOffScreen", "-nosound", f"-carla-rpc-port={ports.rpc}",
           f"-carla-streaming-port={ports.streaming}", f"-carla-primary-port={ports.primary}"]
    if gpu is not None:
        cmd.append(f"-graphicsadapter={int(gpu)}")
    if no_rendering:
        cmd.append("-nullrhi")
    cmd.extend(extra_args)
    return cmd


_PROBE = ("import sys, carla\n"
          "c = carla.Client(sys.argv[1], int(sys.argv[2]))\n"
          "c.set_timeout(float(sys.argv[3]))\n"
          "print(c.get_server_version(), flush=True)\n")


def probe_version(host: str, port: int, timeout: float = 2.0, python: str | None = None) -> str | None:
    """The server's version via a fresh ``carla.Client`` in a subprocess, or None if it does not answer in time."""
    try:
        out = subprocess.run([python or sys.executable, "-c", _PROBE, host, str(port), str(timeout)],
                             capture_output=True, text=True, timeout=timeout + 10.0)
    except subprocess.TimeoutExpired:
        return None
    lines = out.stdout.strip().splitlines()
    return lines[-1].strip() if out.returncode == 0 and lines else None


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"


# ---------------------------------------------------------------------------------------------- one server
@dataclass
class CarlaServer:
    """One managed server process. ``restarts`` counts restarts after the first start."""

    executable: Path
    ports: PortBlock
    log_dir: Path
    host: str = "127.0.0.1"
    gpu: int | None = None
    no_rendering: bool = False
    extra_args: tuple[str, ...] = ()
    ready_timeout: float = 180.0
    probe_timeout: float = 2.0
    check_version: bool = True
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    proc: subprocess.Popen | None = None

    @property
    def command(self) -> list[str]:
        return launch_command(self.executable, self.ports, self.gpu, self.no_rendering, self.extra_args)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"carla_{self.ports.rpc}.log"

    @property
    def pid_path(self) -> Path:
        """``log_dir/carla_<rpc port>.pid``: the running server's process (group) id, for operators and tests."""
        return self.log_dir / f"carla_{self.ports.rpc}.pid"

    def start(self) -> None:
        """Start the process as the leader of its own process group; output goes to :attr:`log_path`."""
        if self.alive():
            raise ServerError(f"server on port {self.ports.rpc} is already running (pid {self.proc.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log.info("starting CARLA server: %s", shlex.join(self.command))
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(self.command)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, **self.env})
        self.pid_path.write_text(f"{self.proc.pid}\n")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float | None = None) -> str:
        """Poll with fresh clients until the server answers ``get_server_version``; returns the version.

        Raises :class:`ServerError` (with the log tail) if the process exits or the deadline passes, and on a
        version other than :data:`CLIENT_VERSION` when ``check_version`` is set.
        """
        deadline = time.monotonic() + (self.ready_timeout if timeout is None else timeout)
        while True:
            if not self.alive():
                code = self.proc.returncode if self.proc is not None else None
                raise ServerError(f"CARLA server on port {self.ports.rpc} exited (code {code}) before it was ready; "
                                  f"log {self.log_path}, last lines:\n{log_tail(self.log_path)}")
            left = deadline - time.monotonic()
            if left <= 0:
                break
            version = probe_version(self.host, self.ports.rpc, min(self.probe_timeout, max(left, 0.2)))
            if version is not None:
                if self.check_version and version != CLIENT_VERSION:
                    raise ServerError(f"CARLA server on port {self.ports.rpc} is version {version} but the client is "
                                      f"{CLIENT_VERSION}; their wire formats differ. Install the matching server "
                                      "(or set check_version=false at your own risk)")
                return version
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))
        timeout_s = self.ready_timeout if timeout is None else timeout
        self.kill()
        raise ServerError(f"CARLA server on port {self.ports.rpc} was not ready after {timeout_s:.0f} s (killed); "
                          f"log {self.log_path}, last lines:\n{log_tail(self.log_path)}")

    def healthy(self) -> bool:
        """Cheap liveness: the process runs and its RPC port accepts connections."""
        if not self.alive():
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            return s.connect_ex((self.host, self.ports.rpc)) == 0

    def kill(self, wait: float = 10.0) -> None:
        """Kill the whole process group, reap it, and wait (bounded) until the RPC port is free again."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait / 2 if sig == signal.SIGTERM else wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children of the group may outlive the leader for a moment
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not port_free(self.ports.rpc, self.host, reuse=True):
            time.sleep(0.1)

    def restart(self, timeout: float | None = None) -> str:
        """Kill, start again on the same ports, wait until ready; counts the restart and returns the version."""
        self.kill()
        self.restarts += 1
        log.warning("restarting CARLA server on port %d (restart #%d)", self.ports.rpc, self.restarts)
        self.start()
        return self.wait_ready(timeout)


# ---------------------------------------------------------------------------------------------- N servers
class ServerManager:
    """N servers on disjoint port blocks, GPUs assigned round-robin, started staggered and checked ready."""

    def __init__(self, num_servers: int, executable: str | os.PathLike | None = None, log_dir: str | os.PathLike =
                 "carla_logs", base_port: int = 2000, port_stride: int = PORT_STRIDE, gpus: Sequence[int] = (),
                 host: str = "127.0.0.1", no_rendering: bool = False, extra_args: Sequence[str] = (),
                 ready_timeout: float = 180.0, stagger: float = 0.05, check_version: bool = True):
        if num_servers < 1:
            raise ServerError(f"num_servers={num_servers}: need at least one server")
        exe = resolve_executable(executable)
        self.allocator = PortAllocator(base_port, port_stride, host=host)
        self.stagger = stagger
        self.servers = [
            CarlaServer(exe, block, Path(log_dir), host=host, gpu=gpus[i % len(gpus)] if gpus else None,
                        no_rendering=no_rendering, extra_args=tuple(extra_args), ready_timeout=ready_timeout,
                        check_version=check_version)
            for i, block in enumerate(self.allocator.allocate_many(num_servers))]

    def start_all(self) -> list[str]:
        for s in self.servers:
            s.start()
            time.sleep(self.stagger)
        try:
            return [s.wait_ready() for s in self.servers]
        except ServerError:
            self.close()
            raise

    def check_health(self) -> list[int]:
        """Restart every server that is not :meth:`CarlaServer.healthy`; returns their indices."""
        restarted = []
        for i, s in enumerate(self.servers):
            if not s.healthy():
                s.restart()
                restarted.append(i)
        return restarted

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self.servers)

    def close(self) -> None:
        for s in self.servers:
            s.kill()
            self.allocator.release(s.ports)

    def __enter__(self) -> "ServerManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
