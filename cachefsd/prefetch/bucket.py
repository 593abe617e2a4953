"""The prefetch bandwidth cap (``prefetch.bandwidth``): a token bucket.

Pure: driven by the time its caller passes in (the prefetcher's clock). No
lock: the prefetcher's ``_lock`` guards it with the accounts and the reach,
as one budget decision reads all three.
"""

from __future__ import annotations


class TokenBucket:
    """At most ``rate`` bytes a second, in bursts of at most a second's
    worth (a bucket one second deep). A rate of 0 is no cap: every spend
    succeeds."""

    def __init__(self, rate: int, now: float) -> None:
        self._rate = rate
        self._tokens = float(rate)
        self._at = now

    def spend(self, nbytes: int, now: float) -> bool:
        """Take ``nbytes`` of tokens at ``now``, if the bucket holds that
        many, or is full: a block larger than a second's worth still goes,
        once a second, leaving the bucket in debt."""
        rate = self._rate
        if not rate:
            return True
        self._tokens = min(float(rate), self._tokens + (now - self._at) * rate)
        self._at = now
        if self._tokens < nbytes and self._tokens < rate:
            return False
        self._tokens -= nbytes
        return True

    def refund(self, nbytes: int) -> None:
        """Give back the tokens spent on a block the prefetch does not hold
        after all (found cached, fetched by a read, failed, or refused by
        the cache on arrival)."""
        if self._rate:
            self._tokens += nbytes
