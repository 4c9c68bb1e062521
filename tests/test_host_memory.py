"""The host allocator keeps freed memory once an env is built on the CPU (envs/host_memory.py)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import ctypes, envs, envs.host_memory as h; envs.make_env('sim', 2, 'cpu', 0, num_routes=2); "
         "print(h._applied)")


def _probe(**env: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_a_cpu_env_raises_the_allocator_thresholds_unless_told_not_to() -> None:
    assert _probe() == "True"
    assert _probe(CARL_KEEP_FREED_MEMORY="0") == "False"
