"""One writer per run folder: the process that trains or evaluates in a folder holds ``<folder>/.carl.lock``.

The hold is an exclusive ``flock`` on that file, which the kernel drops when the holder dies in any way (``kill -9``
included), so a lock left by a killed process is stale by construction and the next process takes it over. The
file also records who holds it (pid, host, command, start time) for the message a refused process prints; a holder
that ends normally removes it. A second check catches file systems that do not honour ``flock``: a recorded holder
on this host whose process is still the same one (pid and start time) is never taken over.

On a cluster file system (NFS v4, Lustre with ``flock`` mounts) the lock works across hosts; a holder's lock there
ends when its host's lease does (NFS: about 90 s after a node dies), which ``lock_wait_s`` can wait out.

:func:`claim_run_dir` is carl-train's way in: hold the folder, then check it (a resume needs ``last.pt``, a new run
an empty folder). carl-eval holds its ``out_dir`` with :class:`RunLock` directly.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from carl.config import ConfigError, TrainConfig

LOCK_NAME = ".carl.lock"
POLL_S = 0.5
_REPLACED = object()  # the lock file was replaced between open and lock: try again at once


class RunFolderBusy(ConfigError):
    """Another living process writes in this run folder; the message names it and the fix."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run folder."""

    pid: int
    host: str
    command: str
    started: str  # local time, for people
    proc_start: int  # the process's start time in clock ticks after boot (Linux), -1 where unknown: pid reuse check

    def describe(self) -> str:
        if self.pid <= 0:
            return "another process (its record is not written yet)"
        return f"{self.command} (pid {self.pid} on host {self.host}, since {self.started})"

    def alive_here(self) -> bool:
        """Whether this is a process of this host that still runs (the same process, not a reused pid)."""
        if self.host != socket.gethostname() or self.pid == os.getpid():
            return False
        start = _proc_start(self.pid)
        return start is not None and (self.proc_start < 0 or start == self.proc_start)


def _proc_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks (``/proc/<pid>/stat`` field 22); None if no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return -1


UNKNOWN = Holder(0, "", "", "", -1)  # a holder that has locked but not yet written its record


def _me() -> Holder:
    command = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    return Holder(os.getpid(), socket.gethostname(), command, time.strftime("%Y-%m-%d %H:%M:%S"),
                  _proc_start(os.getpid()) or -1)


def _read(fd: int) -> Holder | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 4096).decode() or "null")
        return Holder(**data) if isinstance(data, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def busy(folder: Path, holder: Holder, key: str) -> RunFolderBusy:
    stop = f"stop it (kill {holder.pid})" if holder.pid > 0 else "stop it"
    return RunFolderBusy(f"{key}={folder} is in use by {holder.describe()}: one process writes in a run folder at a "
                         f"time. Wait for it to end, or {stop}; the folder of a process that was killed is taken over")


def holder(folder: str | Path) -> Holder | None:
    """The living process that holds ``folder`` now, or None (a peek: nothing is taken)."""
    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        recorded = _read(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return recorded or UNKNOWN
        fcntl.flock(fd, fcntl.LOCK_UN)
        return recorded if recorded is not None and recorded.alive_here() else None
    finally:
        os.close(fd)


def _try_take(path: Path) -> tuple[int | None, object]:
    """One attempt at the lock: ``(fd, the dead holder's record or None)`` when it is ours, ``(None, holder)`` while
    a living process holds it, ``(None, _REPLACED)`` when the file changed under us."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        recorded = _read(fd)
        os.close(fd)
        return None, recorded or UNKNOWN
    try:  # the holder before us may have removed the file between our open and our lock: lock the new one
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return None, _REPLACED
    previous = _read(fd)
    if previous is not None and previous.alive_here():  # a file system that ignores flock
        os.close(fd)
        return None, previous
    return fd, previous


class RunLock:
    """The hold on one run folder: :meth:`acquire` (refuse, wait, or take over a stale one), :meth:`release`."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.path: Path | None = None

    def acquire(self, folder: str | Path, key: str = "run_dir", wait_s: float = 0.0) -> Holder | None:
        """Hold ``folder`` (created if missing); returns the dead holder it took over, if any. Raises
        :class:`RunFolderBusy` naming the holder if another living process keeps it past ``wait_s`` seconds."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK_NAME
        deadline = time.monotonic() + max(wait_s, 0.0)
        while True:
            fd, record = _try_take(path)
            if fd is not None:
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
                os.write(fd, json.dumps(asdict(_me())).encode())
                os.fsync(fd)
                self.fd, self.path = fd, path
                return record
            if record is _REPLACED:
                continue
            if time.monotonic() >= deadline:
                raise busy(folder, record, key)
            time.sleep(POLL_S)

    def release(self) -> None:
        """Give the folder up (idempotent): the record goes, then the lock."""
        if self.fd is None:
            return
        try:
            if self.path is not None:
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = self.path = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def took_over(previous: Holder | None) -> str:
    """The line a process prints when it took over a dead holder's folder ('' if there was none)."""
    return f"took over the run folder from {previous.describe()}, which is no longer running" if previous else ""


def run_dir_of(cfg: TrainConfig) -> Path:
    """``resume``, else ``run_dir``, else ``runs/<experiment>-<timestamp>``."""
    if cfg.resume:
        return Path(cfg.resume)
    return Path(cfg.run_dir) if cfg.run_dir else Path("runs") / f"{cfg.experiment}-{time.strftime('%Y%m%d-%H%M%S')}"


def claim_run_dir(cfg: TrainConfig, lock: RunLock) -> Path:
    """Hold the run folder (:mod:`carl.runlock`: refused while another process trains there), then check it: a
    resume needs its ``last.pt``, a new run a folder that holds no run."""
    run_dir = run_dir_of(cfg)
    previous = lock.acquire(run_dir, "resume" if cfg.resume else "run_dir", cfg.lock_wait_s)
    try:
        if cfg.resume and not (run_dir / "last.pt").is_file():
            raise ConfigError(f"resume={cfg.resume}: {run_dir / 'last.pt'} does not exist (nothing to resume)")
        if not cfg.resume and ((run_dir / "config.yaml").exists() or (run_dir / "last.pt").exists()):
            raise ConfigError(
                f"run_dir={run_dir} already holds a run; continue it with resume={run_dir} or pick another run_dir="
            )
    except ConfigError:
        lock.release()
        raise
    if previous is not None:
        print(took_over(previous), flush=True)
    return run_dir
