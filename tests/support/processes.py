"""Helpers for tests of the CARLA backend: a ``CarlaUE4.sh`` stand-in launcher, small fake executables, and a
process census (``/proc``, Linux) to check that no process outlives the test that started it.

Test support, not runtime code: it lives under ``tests/`` so that the installed ``envs`` package carries no test
doubles."""
from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

STANDIN = Path(__file__).with_name("carla_standin.py")


def write_script(path: Path, body: str) -> Path:
    """An executable shell script at ``path``."""
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def standin_executable(folder: Path, xodr: str | Path, maps_dir: str | Path | None = None,
                       extra: tuple[str, ...] = ()) -> Path:
    """A ``CarlaUE4.sh`` replacement that runs the protocol stand-in with the CARLA flags it is given.

    It runs ``carla_standin.py`` as a script by path, which keeps torch (and pytest's ``sys.path``) out of the server
    process; the script adds the repository root to its own ``sys.path`` to import the map compiler from ``envs``.
    """
    args = [sys.executable, str(STANDIN), "--map", str(xodr), *extra]
    if maps_dir is not None:
        args += ["--maps-dir", str(maps_dir)]
    return write_script(Path(folder) / "CarlaUE4.sh", f'exec {shlex.join(args)} "$@"')


# ---------------------------------------------------------------------------------------------- process census
TAG_VAR = "CARL_PROCESS_TAG"  # environment variable that marks every process a test (session) started
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")  # live as long as their parent; harmless


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    state: str  # R, S, D, Z (zombie), ...
    cmdline: str


def _proc(pid: int) -> Proc | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return Proc(pid, int(fields[1]), int(fields[2]), fields[0], cmd)


def processes() -> dict[int, Proc]:
    """Every process this user can see, by pid (empty where there is no ``/proc``)."""
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit() and (p := _proc(int(name))) is not None:
            out[p.pid] = p
    return out


def descendants(root: int, table: dict[int, Proc] | None = None) -> set[int]:
    """Living (non-zombie) descendants of ``root`` that are still attached to it."""
    table = processes() if table is None else table
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = set(), list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return {pid for pid in out if table[pid].state != "Z"}


def tagged(value: str, table: dict[int, Proc] | None = None) -> set[int]:
    """Living processes whose environment holds ``TAG_VAR=value``: everything started (at any depth, also when
    re-parented to init) by a process that had the tag in its environment."""
    table = processes() if table is None else table
    needle = f"{TAG_VAR}={value}".encode()
    out = set()
    for p in table.values():
        if p.state == "Z" or p.pid == os.getpid():
            continue
        try:
            env = Path(f"/proc/{p.pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.add(p.pid)
    return out


def is_helper(p: Proc) -> bool:
    return any(h in p.cmdline for h in HELPERS)


def survivors(before: Iterable[int], tag: str | None = None, root: int | None = None) -> dict[int, Proc]:
    """Processes started since ``before`` (pids) that are still alive: tagged with ``tag`` or descendants of ``root``
    (default: this process), apart from multiprocessing's helper processes."""
    table = processes()
    pids = descendants(os.getpid() if root is None else root, table)
    if tag is not None:
        pids |= tagged(tag, table)
    keep = set(before)
    return {pid: table[pid] for pid in sorted(pids - keep) if pid in table and not is_helper(table[pid])}


def wait_for(check: Callable[[], dict[int, Proc]], timeout: float = 10.0, period: float = 0.1) -> dict[int, Proc]:
    """Poll ``check`` until it returns nothing or ``timeout`` passes; returns its last answer."""
    deadline = time.monotonic() + timeout
    while True:
        left = check()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(period)


def describe(procs: dict[int, Proc]) -> str:
    return "\n".join(f"  pid {p.pid} ppid {p.ppid} pgid {p.pgid} [{p.state}] {p.cmdline[:200]}"
                     for p in procs.values())


def kill_all(procs: Iterable[int]) -> None:
    """SIGKILL ``procs`` (clean-up after a failed check, so one leak does not spoil the following tests)."""
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
