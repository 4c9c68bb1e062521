"""Server launcher with a watchdog: runs one server command and takes its whole process group down with its owner.

:class:`envs.carla.servers.CarlaServer` starts every server as ``python launcher.py --owner PID -- CarlaUE4.sh ...``
in a new session, so this process leads the server's process group and the server (``CarlaUE4.sh`` and the
``CarlaUE4-Linux-Shipping`` process it forks) runs in that group beneath it. The launcher

* runs the command and exits with its exit status (a server killed by signal N makes the launcher die of signal N),
  so ``Popen.poll()`` / ``returncode`` of the launcher read like those of the server;
* stops the whole group -- SIGTERM, then SIGKILL after ``--grace`` seconds -- when it receives SIGTERM, SIGINT or
  SIGHUP, and when its owner dies: the kernel signals it when the owner exits (``prctl(PR_SET_PDEATHSIG)``, Linux),
  and it also polls ``getppid()`` (re-parented to init or a subreaper means the owner is gone), which covers other
  platforms and an owner that was SIGKILLed;
* signals the rest of the group when the command exits on its own, so no grandchild outlives it.

Why a launcher and not only ``PR_SET_PDEATHSIG`` in the server's ``preexec_fn``: the death signal reaches only the
direct child (``CarlaUE4.sh``, a shell script that forks the real server without ``exec``), it fires when the
*thread* that forked the child exits (not the process), and ``preexec_fn`` is unsafe in a multi-threaded owner (the
``carla`` client runs threads). Here the death signal is set by the launcher on itself and used only as a wake-up: the
launcher checks that its parent really changed before it acts.

Standard library only, run as a script (``python -I -S launcher.py``), so it starts in a few milliseconds and
imports nothing of this repository.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
POLL_S = 0.2  # how often the owner is checked


def set_parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` on the calling process (Linux); False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _kill_group(sig: int) -> None:
    try:
        os.killpg(0, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run a CARLA server command; stop its process group with the owner")
    p.add_argument("--owner", type=int, required=True, help="pid of the owning process (this process's parent)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the server command line")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no server command given")

    stop: list[str] = []  # why to stop; set from signal handlers

    def on_signal(signum: int, _frame: object) -> None:
        stop.append(signal.Signals(signum).name)

    def on_parent_death(_signum: int, _frame: object) -> None:  # may also be a thread of the owner exiting
        if os.getppid() != args.owner:
            stop.append("owner died")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGUSR1, on_parent_death)
    set_parent_death_signal(signal.SIGUSR1)
    if os.getppid() != args.owner:  # the owner died before the death signal was armed
        return 1
    child = subprocess.Popen(cmd)  # same process group (ours), inherits stdin/stdout/stderr

    while True:
        try:
            code = child.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if not stop and os.getppid() != args.owner:
            stop.append("owner died")
        if stop:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group signal below must not end us early
            _kill_group(signal.SIGTERM)
            deadline = time.monotonic() + args.grace
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            _kill_group(signal.SIGKILL)  # stragglers of the group, and this launcher with them
            return 1  # not reached

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _kill_group(signal.SIGTERM)  # the command is gone: nothing it started may outlive it
    if code < 0:  # die of the same signal, so the owner sees what happened to the server
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)
    return code


if __name__ == "__main__":
    sys.exit(main())
