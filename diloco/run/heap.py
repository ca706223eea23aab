"""Freed memory back to the OS: glibc keeps the blocks a process frees below its mmap threshold (tensors up to
32 MB, lz4 frames) for reuse, so a process that frees many of them and then allocates one large block holds
both.

Contract: `release_freed_memory()` asks glibc (malloc_trim) to return free heap pages; `map_large_blocks()`
fixes the mmap threshold (every block of at least that size is its own mapping, returned to the OS when
freed); nothing else changes (no allocation moves); each a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc malloc.h)
LARGE_BLOCK_BYTES = 1 << 20


@cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def _malloc_trim():
    return getattr(_libc(), "malloc_trim", None)


def map_large_blocks(threshold_bytes: int = LARGE_BLOCK_BYTES) -> bool:
    """Every allocation of at least `threshold_bytes` gets its own mapping, for good: glibc's default
    threshold grows with each large block freed (up to 32 MB), after which a model's gradients and temporaries
    of a few MB each come from the heap and stay in the process when freed (measured at 124M parameters: 19.4
    B/param between steps instead of 15.6, 23.1 at a step's peak instead of 22.0). Whether it was set."""
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, threshold_bytes))


def release_freed_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A memory field of /proc/<pid>/status in bytes (VmRSS: resident now; VmHWM: its high-water mark), or
    None (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
