"""Helpers for tests of the CARLA backend: a ``CarlaUE4.sh`` stand-in launcher and small fake executables."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

STANDIN = Path(__file__).with_name("standin.py")


def write_script(path: Path, body: str) -> Path:
    """An executable shell script at ``path``."""
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def standin_executable(folder: Path, xodr: str | Path, maps_dir: str | Path | None = None,
                       extra: tuple[str, ...] = ()) -> Path:
    """A ``CarlaUE4.sh`` replacement that runs the protocol stand-in with the CARLA flags it is given.

    It runs ``standin.py`` as a script (not ``-m envs.carla.standin``), which keeps torch out of the server process.
    """
    args = [sys.executable, str(STANDIN), "--map", str(xodr), *extra]
    if maps_dir is not None:
        args += ["--maps-dir", str(maps_dir)]
    return write_script(Path(folder) / "CarlaUE4.sh", f'exec {shlex.join(args)} "$@"')
