"""The prefetcher's in-flight accounting: the blocks it fetched ahead and
nobody has read yet, the blocks and GETs it has in flight, the reads that
joined one of its GETs, and the blocks whose prefetch failed lately.

The budget is checked against these counts (``engine.py``): GETs in flight
against the concurrency, bytes ahead against the reach, bytes in flight
against the cache's room. Pure: times are passed in. No lock: the
prefetcher's ``_lock`` guards it with the reach and the token bucket, as one
budget decision reads all three.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass

from cachefsd.cache.index import BlockRef
from cachefsd.store.base import ObjectInfo


@dataclass(frozen=True)
class Ahead:
    """A block fetched ahead and not yet read."""

    info: ObjectInfo
    index: int
    digest: str
    nbytes: int
    workload: str  # the workload whose prediction fetched it (``Prediction.workload``)


class Accounts:
    def __init__(self) -> None:
        self._ahead: dict[BlockRef, Ahead] = {}
        self.ahead_bytes = 0
        self._in_flight: dict[BlockRef, int] = {}  # block -> its bytes
        self.in_flight_bytes = 0
        self.gets = 0  # runs submitted and not over: the concurrency is in runs
        # Blocks read while their prefetch was still in flight: the reader
        # joined the GET, so the prefetch is used (late) and plans nothing.
        self._joined: set[BlockRef] = set()
        self._failed: dict[BlockRef, float] = {}  # block -> when it may be tried again

    def holds(self, ref: BlockRef) -> bool:
        """Whether ``ref`` is ahead or in flight: it needs no new fetch."""
        return ref in self._ahead or ref in self._in_flight

    def failed_lately(self, ref: BlockRef, now: float) -> bool:
        """Whether ``ref``'s prefetch failed and may not be tried again yet;
        a failure whose time is up is forgotten."""
        retry_at = self._failed.get(ref)
        if retry_at is None:
            return False
        if now < retry_at:
            return True
        del self._failed[ref]
        return False

    def failed(self, refs: Iterable[BlockRef], retry_at: float) -> None:
        """The prefetch of ``refs`` failed: not to be tried again before ``retry_at``."""
        for ref in refs:
            self._failed[ref] = retry_at

    def start(self, ref: BlockRef, nbytes: int) -> None:
        """Block ``ref`` (``nbytes``) is claimed for a fetch."""
        self._in_flight[ref] = nbytes
        self.in_flight_bytes += nbytes

    def get_started(self) -> None:
        self.gets += 1

    def get_over(self) -> None:
        self.gets -= 1

    def read(self, ref: BlockRef) -> int:
        """A read of block ``ref``: the bytes fetched ahead it uses, 0 if
        none. A read of a block in flight joins its GET (``joined`` at landing)."""
        if ref in self._in_flight:
            self._joined.add(ref)
            return 0
        ahead = self._ahead.pop(ref, None)
        if ahead is None:
            return 0
        self.ahead_bytes -= ahead.nbytes
        return ahead.nbytes

    def landed(self, ref: BlockRef) -> bool:
        """Block ``ref``'s fetch is over, however it turned out: whether a
        read joined it meanwhile."""
        self.in_flight_bytes -= self._in_flight.pop(ref)
        joined = ref in self._joined
        self._joined.discard(ref)
        return joined

    def put_ahead(self, ref: BlockRef, block: Ahead) -> None:
        """Block ``ref`` landed in the cache and awaits its read."""
        self._ahead[ref] = block
        self.ahead_bytes += block.nbytes

    def ahead(self) -> list[tuple[BlockRef, Ahead]]:
        return list(self._ahead.items())

    def digests_of(self, workloads: Container[str]) -> list[str]:
        """The hashes of the blocks fetched ahead for ``workloads``."""
        return [block.digest for block in self._ahead.values() if block.workload in workloads]

    def retire(self, refs: Iterable[BlockRef]) -> int:
        """Blocks ``refs`` left the cache unread: the bytes wasted (of those
        still ahead)."""
        wasted = 0
        for ref in refs:
            block = self._ahead.pop(ref, None)
            if block is not None:
                self.ahead_bytes -= block.nbytes
                wasted += block.nbytes
        return wasted
