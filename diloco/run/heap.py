"""Freed memory back to the OS: glibc keeps the blocks a process frees below its mmap threshold (tensors up to
32 MB, lz4 frames) for reuse, so a process that frees many of them and then allocates one large block holds both.

Contract: `release_freed_memory()` asks glibc (malloc_trim) to return free heap pages; nothing else changes
(no allocation moves); a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
