"""Giving the host memory a load freed back to the operating system.

Loading a model makes and drops many large temporaries (the parsed protobuf's raw bytes, numpy
conversions, codes replaced by a packed layout). glibc's allocator keeps freed heap pages for
reuse, so the process's resident memory after a load depends on how those frees fell, not on what
the session holds; ``malloc_trim`` hands the free pages back, which makes resident memory what is
in use. Elsewhere (no glibc: macOS, musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_host_memory() -> bool:
    """Return the heap's free pages to the OS; whether the platform allows it (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
