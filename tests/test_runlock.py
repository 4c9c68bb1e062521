"""One writer per run folder (carl/runlock.py): a second carl-train on a folder in use is refused naming the holder;
after a ``kill -9`` the folder is taken over and the run continues from ``last.pt``; the same for carl-eval's
``out_dir``; stale records (a dead pid, a reused one) and file systems that ignore ``flock``."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from carl.checkpoint import load_checkpoint
from carl.runlock import LOCK_NAME, RunFolderBusy, RunLock, holder
from test_train_cli import REPO, TINY


def record(folder: Path, pid: int, proc_start: int = -1, host: str | None = None) -> None:
    """A lock file as a holder writes it, without holding the lock (what a killed holder leaves)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                                "command": "carl-train", "started": "then",
                                                "proc_start": proc_start}))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_held_folder_is_refused_and_released(tmp_path: Path) -> None:
    with RunLock() as first:
        assert first.acquire(tmp_path / "run") is None
        seen = holder(tmp_path / "run")
        assert seen is not None and seen.pid == os.getpid()
        with pytest.raises(RunFolderBusy, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
            RunLock().acquire(tmp_path / "run")
        t0 = time.monotonic()
        with pytest.raises(RunFolderBusy):
            RunLock().acquire(tmp_path / "run", wait_s=1.0)
        assert time.monotonic() - t0 >= 1.0
    assert holder(tmp_path / "run") is None and not (tmp_path / "run" / LOCK_NAME).exists()
    with RunLock() as again:
        assert again.acquire(tmp_path / "run") is None  # a clean release leaves nothing to take over


def test_a_holder_without_a_record_is_named_without_a_pid(tmp_path: Path) -> None:
    """Locked but not yet written (the holder is between flock and write): refused, and no `kill` is suggested."""
    import fcntl

    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(RunFolderBusy) as err:
            RunLock().acquire(tmp_path)
        assert "another process (its record is not written yet)" in str(err.value) and "(kill " not in str(err.value)
        assert holder(tmp_path).pid == 0
    finally:
        os.close(fd)


def test_a_dead_holder_is_taken_over(tmp_path: Path) -> None:
    pid = dead_pid()
    record(tmp_path, pid)
    assert holder(tmp_path) is None
    with RunLock() as lock:
        previous = lock.acquire(tmp_path)
        assert previous is not None and previous.pid == pid
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_living_holder_is_respected_where_flock_is_not(tmp_path: Path) -> None:
    """A record of a process of this host that still runs is never taken over, even when the lock itself is free
    (a file system that ignores flock); the same pid with another start time is a reused pid: taken over."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = int(Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        record(tmp_path, sleeper.pid, start)
        assert holder(tmp_path).pid == sleeper.pid
        with pytest.raises(RunFolderBusy, match=f"kill {sleeper.pid}"):
            RunLock().acquire(tmp_path)
        record(tmp_path, sleeper.pid, start + 1)
        with RunLock() as lock:
            assert lock.acquire(tmp_path).pid == sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()


def test_eval_out_dir_in_use_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from carl.eval.cli import main

    with RunLock() as lock:
        lock.acquire(tmp_path / "eval")
        with pytest.raises(SystemExit) as exit_:
            main(["policy=expert", "benchmark=towns", f"out_dir={tmp_path / 'eval'}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"out_dir={tmp_path / 'eval'} is in use by" in err and str(os.getpid()) in err


def test_resume_is_refused_while_the_run_trains_then_takes_over_after_kill_9(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    from carl.train import main

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [*TINY, "ppo.total_timesteps=1000000", "logging.eval_episodes=0", "logging.tensorboard=false",
            "logging.progress_bar=false", f"run_dir={run_dir}"]
    first = subprocess.Popen([sys.executable, "-m", "carl.train", *args], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            main(list(argv))
        assert exit_.value.code == 2
        return capsys.readouterr().err

    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "last.pt").exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
        assert (run_dir / "last.pt").exists() and first.poll() is None
        err = refused(f"resume={run_dir}")
        assert f"resume={run_dir} is in use by" in err and f"pid {first.pid}" in err
        assert f"pid {first.pid}" in refused(*TINY, f"run_dir={run_dir}")  # a new run in the same folder: alike
        assert first.poll() is None  # the first run was not disturbed
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    update = load_checkpoint(run_dir / "last.pt")["update"]
    resumed = subprocess.run([sys.executable, "-m", "carl.train", f"resume={run_dir}",
                              f"ppo.total_timesteps={(update + 1) * 16}"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"pid {first.pid}" in resumed.stdout and "no longer running" in resumed.stdout
    assert f"at update {update}" in resumed.stdout
    assert load_checkpoint(run_dir / "last.pt")["update"] == update + 1
    assert not (run_dir / LOCK_NAME).exists()
