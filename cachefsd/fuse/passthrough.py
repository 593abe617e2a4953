"""Whether a mount's files are worth the OPEN requests passthrough needs
(``OpenSizes``). Which opens the kernel serves itself from a cache file,
by the kernel's rules for an inode, is the native plane's table
(``native/src/opens.rs``), kept for the native workers' opens and
Python's alike.
"""

from __future__ import annotations

import threading

# The opens a mount's files are judged by (``OpenSizes``).
JUDGED_OPENS = 64


class OpenSizes:
    """Whether a mount's files are worth an OPEN request each, judged by the
    sizes of the first ``JUDGED_OPENS`` files opened.

    Passthrough needs an OPEN (and a RELEASE) for every open. A file larger
    than one read saves the daemon at least two READs by it; a file of one
    read or less saves one READ, or none when the kernel still holds its
    pages, so for a mount of such files no-open (the kernel opening files
    without asking, keeping their pages) costs fewer requests: measured,
    images of 96-160 KiB read at 0.05 x the local disk's speed through
    passthrough with their pages kept, 1.0 x without OPEN requests, and
    equally fast through both with the pages dropped. The verdict is for
    good: a kernel told once that OPEN is not implemented never sends it
    again."""

    def __init__(self, read_size: int) -> None:
        self._read_size = read_size
        self._lock = threading.Lock()
        self._large = 0
        self._judged = 0

    @property
    def judging(self) -> bool:
        """Whether opens still count towards the verdict."""
        with self._lock:
            return self._judged < JUDGED_OPENS

    def opened(self, size: int) -> bool | None:
        """Count an open of a file of ``size`` bytes: None until the mount
        is judged, then whether its files are worth an OPEN (once)."""
        with self._lock:
            if self._judged >= JUDGED_OPENS:
                return None
            self._judged += 1
            self._large += size > self._read_size
            if self._judged < JUDGED_OPENS:
                return None
            return 2 * self._large >= self._judged
