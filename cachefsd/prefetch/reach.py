"""How far ahead the prefetcher may reach: AIMD, as TCP's congestion window.

Pure: bytes in, the reach out. No lock: the prefetcher's ``_lock`` guards it
with the accounts and the token bucket, as one budget decision reads all three.
"""

from __future__ import annotations


class Reach:
    """How many bytes the prefetcher may hold fetched ahead and not yet
    read. Every byte fetched ahead and read earns a byte of reach, up to
    ``limit``; bytes thrown away unread (a cache too small for the reach)
    halve it, down to ``floor``.

    As TCP halves at most once per window of data, a cut is followed by a
    recovery: until a reach's worth of bytes (the reach after the cut) has
    left the ahead set, read or thrown away, waste cuts nothing more and
    reads earn nothing. Waste comes in bursts: at an epoch's start a full
    cache has no room until reads free some, and halving once per wasted
    block took the reach from 260 MB to the floor within a second, which
    held a 50 % cache to 73 % hits for the epoch instead of 84-86 %.
    Persistent waste still halves the reach once per recovery, down to the
    floor."""

    def __init__(self, initial: int, floor: int, limit: int) -> None:
        self._floor = floor
        self._limit = limit
        self.bytes = initial
        self._recovering = 0  # bytes still to leave the ahead set before the next cut

    def used(self, nbytes: int) -> None:
        recovered = min(nbytes, self._recovering)
        self._recovering -= recovered
        self.bytes = min(self._limit, self.bytes + nbytes - recovered)

    def wasted(self, nbytes: int) -> None:
        if self._recovering:
            self._recovering = max(0, self._recovering - nbytes)
            return
        self.bytes = max(self._floor, self.bytes // 2)
        self._recovering = self.bytes
