"""Block-sized buffers from an allocator that keeps them (``reuse_block_buffers``)."""

from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
# The largest mmap threshold glibc accepts on 64-bit machines.
_MMAP_THRESHOLD_MAX = 32 << 20


def reuse_block_buffers() -> None:
    """Serve block-sized buffers (cold GETs, frames) from heaps that keep
    their freed memory, instead of a fresh mmap each: the kernel zeroes and
    faults in every page of a fresh one, which cost more CPU than the
    copies into it (a cold 32 MiB stream: 150 page faults and 1.2 ms of
    system time a MiB, against 4-13 and 0.55). Each heap (arena) gives back
    what it holds free above 128 MiB, and there are at most 4 (glibc makes
    up to 8 a core), so at most about 600 MiB is kept on any node. Blocks
    over 32 MiB (glibc's largest threshold) are still mmapped. Not glibc:
    nothing to do."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return
    mallopt(_M_ARENA_MAX, 4)
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    mallopt(_M_TRIM_THRESHOLD, 128 << 20)
    mallopt(_M_TOP_PAD, 16 << 20)
