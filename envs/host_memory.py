"""Keep freed host memory inside the process, so that a batched step does not page-fault its tensors back in.

A CPU step allocates and frees the same few hundred tensors every step (a few KB to a few hundred MB each). glibc's
defaults hand every block above its mmap threshold (128 KB, raised only as far as the largest block freed so far) to
the kernel on free, and trim the heap top beyond 128 KB, so the next step maps and zero-fills the same pages again:
on 2 cores up to 45 % of a simulator step (a fresh process at batch 1024: 17.6 -> 9.4 ms per step; a BEV step at
batch 1024: 228-256 -> 129-159 ms) and of the BEV preset's PPO update (1.61-1.73 -> 0.87-0.94 s; docs/training.md,
"Host memory"). Raising both thresholds keeps the pages: the peak resident memory grows by
about the largest step's working set (+47 MB, 6 %, for the quick preset).

Process-wide and idempotent; a no-op outside glibc. ``CARL_KEEP_FREED_MEMORY=0`` leaves the allocator alone.
"""
from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD = 256 * 2**20  # blocks below this come from the heap and go back to it
TRIM_THRESHOLD = 2**30  # free memory the heap keeps at its top
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True when they are set (now or before)."""
    global _applied
    if _applied is None:
        _applied = False
        if os.environ.get("CARL_KEEP_FREED_MEMORY", "1") != "0" and platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL("libc.so.6")
            except OSError:
                return False
            _applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
                libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
