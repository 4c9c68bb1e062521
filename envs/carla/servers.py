"""CARLA server management: port blocks, launch command lines, readiness probes, health checks, kill and restart.

One :class:`CarlaServer` is one ``CarlaUE4.sh`` process on a disjoint :class:`PortBlock`, started through the
watchdog launcher (:mod:`envs.carla.launcher`) as the leader of its own process group, so the launcher, the shell
script and the ``CarlaUE4-Linux-Shipping`` child die together, and die with the process that started them.
:class:`ServerManager` owns N of them.

Process lifetime: no server outlives its owner. A server is stopped by process group (SIGTERM, SIGKILL after a grace
period) on :meth:`CarlaServer.kill`, by the owner's ``atexit`` hook and SIGTERM handler (:func:`track`, which
:class:`envs.carla.vector.CarlaVectorEnv` uses too), and by its launcher when the owner dies without cleaning up
(SIGKILL, a crash).

Nothing here imports ``carla``: readiness is probed by a fresh client in a subprocess (:func:`probe_version`), because
a misbehaving server can abort the client process (``std::terminate``), and because an old ``carla.Client`` never
reconnects after a restart.

Errors are :class:`ServerError` with the cause and the fix (missing ``CARLA_ROOT``, a server that never becomes
ready -- with the tail of its log --, a version mismatch, no free ports).

One file, on purpose: port blocks, launch lines, probes and process-group kills are the lifetime of one server
process and share its rules (who owns a group, when it counts as dead); :class:`CarlaServer` uses all of them.
"""
from __future__ import annotations

import atexit
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)

CLIENT_VERSION = "0.9.16"  # the pinned ``carla`` client the workers and the stand-in speak
PORT_STRIDE = 4  # ports per block: rpc, streaming (= rpc + 1), primary (rpc + 2), traffic manager (rpc + 3)
LOG_TAIL_LINES = 30
LAUNCHER = Path(__file__).with_name("launcher.py")  # the watchdog every server runs under
KILL_GRACE = 5.0  # seconds a server gets between SIGTERM and SIGKILL


class ServerError(RuntimeError):
    """A CARLA server could not be found, started, reached or kept alive; the message says why and what to do."""


class CarlaError(RuntimeError):
    """A CARLA setup problem the worker cannot recover from (wrong town, version mismatch, restart budget spent, a
    blueprint the server lacks)."""


# ---------------------------------------------------------------------------------------------- lifetime
# Everything that owns server processes (servers, vector envs) registers here, so that the owner's interpreter exit
# and a SIGTERM stop them. A crashed owner (SIGKILL) is covered by the launcher's watchdog instead.
_LIVE: dict[int, "weakref.ref[Any]"] = {}  # id -> owner; a dict, since dataclass instances are unhashable
_HOOKS = {"pid": 0, "atexit": False, "signals": False}  # per process: a forked child owns nothing of its parent
_HOOK_LOCK = threading.Lock()
HOOKED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _this_process() -> None:
    if _HOOKS["pid"] != os.getpid():  # first use here, or a fork: forget the parent's owners and hooks
        _LIVE.clear()
        _HOOKS.update(pid=os.getpid(), atexit=False, signals=False)


def track(owner: Any) -> None:
    """Register ``owner`` (it has ``close()`` and ``_emergency_stop()``) for clean-up at this process's exit and on
    its SIGTERM / SIGHUP."""
    with _HOOK_LOCK:
        _this_process()
        _LIVE[id(owner)] = weakref.ref(owner)
        _install_exit_hooks()


def untrack(owner: Any) -> None:
    _LIVE.pop(id(owner), None)


def _owned() -> list[Any]:
    if _HOOKS["pid"] != os.getpid():
        return []
    return [o for o in (r() for r in list(_LIVE.values())) if o is not None]


def stop_all(graceful: bool = False) -> None:
    """Stop every registered owner of this process: ``close()`` when ``graceful``, else ``_emergency_stop()``."""
    for owner in _owned():
        try:
            owner.close() if graceful else owner._emergency_stop()
        except Exception:  # noqa: BLE001 - clean-up must go on with the others
            log.exception("stopping %r failed", owner)


def _on_signal(signum: int, _frame: Any) -> None:
    """Stop our servers, then die of the signal as the default disposition would have."""
    stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_exit_hooks() -> None:
    """``atexit`` closes what is still open; SIGTERM and SIGHUP, where they still have their default disposition
    (end the process), stop it first and then end the process. A program with its own handler for them (``carl-train``
    finishes the step and saves a checkpoint) keeps it and closes its env itself; ``atexit`` and the launchers'
    watchdogs still cover it. Signal handlers can only be installed from the main thread. SIGINT is left alone: its
    KeyboardInterrupt unwinds ``finally`` blocks and ends at ``atexit``."""
    if not _HOOKS["atexit"]:
        atexit.register(stop_all, True)
        _HOOKS["atexit"] = True
    if _HOOKS["signals"] or threading.current_thread() is not threading.main_thread():
        return
    for sig in HOOKED_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_DFL:
            continue
        try:
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # pragma: no cover - not the main interpreter
            continue
    _HOOKS["signals"] = True


def kill_group(pgid: int | None, grace: float = KILL_GRACE, wait: Callable[[float], bool] | None = None) -> None:
    """SIGTERM the process group ``pgid``, SIGKILL it after ``grace`` seconds if it is still there.

    ``wait(timeout) -> bool`` waits for the group's leader (e.g. ``Popen.wait``); without it the group is polled."""
    if pgid is None or pgid <= 0:
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace
    if wait is not None:
        wait(grace)
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # zombies still count for killpg(0): only living members matter
    return any(_state(pid) not in ("Z", "X", None) for pid in _group_members(pgid))


def _group_members(pgid: int) -> list[int]:
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:  # pragma: no cover - no procfs: assume the group is alive
        return [pgid]
    for name in names:
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid:
                out.append(int(name))
    return out


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def read_pid_file(path: Path) -> int | None:
    """The process group id in a server's pid file, or None."""
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


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
    kill_grace: float = KILL_GRACE  # seconds between SIGTERM and SIGKILL

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
        """Start the process in its own process group under the watchdog launcher; output goes to :attr:`log_path`.

        The launcher (:mod:`envs.carla.launcher`) leads the group, so ``proc.pid`` is the group id; it ends the group
        when this process dies. The server is also registered for this process's exit and SIGTERM (:func:`track`)."""
        if self.alive():
            raise ServerError(f"server on port {self.ports.rpc} is already running (pid {self.proc.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log.info("starting CARLA server: %s", shlex.join(self.command))
        launcher = [sys.executable, "-I", "-S", str(LAUNCHER), "--owner", str(os.getpid()), "--grace",
                    str(self.kill_grace), "--"]
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(self.command)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(launcher + self.command, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, **self.env})
        self.pid_path.write_text(f"{self.proc.pid}\n")
        track(self)

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

    def stop(self, grace: float | None = None) -> None:
        """Stop the whole process group: SIGTERM, SIGKILL after ``grace`` seconds (default :attr:`kill_grace`);
        reap the launcher. Returns without waiting for the ports."""
        untrack(self)
        if self.proc is None:
            return
        proc = self.proc

        def wait(timeout: float) -> bool:
            try:
                proc.wait(timeout=timeout)
                return True
            except subprocess.TimeoutExpired:
                return False

        kill_group(proc.pid, self.kill_grace if grace is None else grace, wait)  # proc.pid is the group id
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL
            log.error("CARLA server group %d did not exit after SIGKILL", proc.pid)

    def kill(self, wait: float = 10.0) -> None:
        """Kill the whole process group (:meth:`stop`), reap it, and wait (bounded) until the RPC port is free."""
        if self.proc is None:
            untrack(self)
            return
        self.stop(min(self.kill_grace, wait / 2))
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not port_free(self.ports.rpc, self.host, reuse=True):
            time.sleep(0.1)

    def close(self) -> None:
        self.kill()

    def _emergency_stop(self) -> None:  # SIGTERM of the owner: be quick
        self.stop(min(self.kill_grace, 2.0))

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
