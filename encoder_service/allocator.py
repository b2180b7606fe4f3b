"""Keeps the memory the vision tower frees inside the process (glibc's malloc, Linux).

By default glibc serves every block over 32 MB (and, until its threshold adapts, over 128 KB)
with a fresh mmap and gives it back on free, so each forward pass page-faults its large
activations in again, and the kernel zeroes every page. Measured on 2 CPU cores with the
2B-shaped tower, a batch of four 448x448 images on a worker thread (as the batcher runs it):
0.52-0.76 M page faults and 11.2-11.3 s per pass by default, against about 1,500 and 10.7 s
with mmap and trimming off, once the first pass has touched the memory. The cost: the process
keeps its peak heap.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes a C int


def retain_freed_memory() -> bool:
    """Turns off mmap for large blocks and heap trimming; True when the allocator took both."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # None: the running program, so glibc itself
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        logger.info("allocator tuning skipped: no glibc mallopt")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
