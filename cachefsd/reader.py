"""From a byte range of one object version to the blocks that hold it.

An object is cut into aligned blocks of ``block_size`` bytes (the last one
shorter). The reader splits a range into blocks and asks the block cache
(``cache.layered.LayeredCache``) for each: its near levels (recent blocks
in RAM, the local tiers) at once; for a block none holds, its remote levels
(the shared tier) and then the origin, once for all concurrent readers of
the block (single-flight), and puts what the origin sent into every level.
A raw tier's block is a ``FileSpan`` of its file, cut like bytes and
handed to the kernel without a copy.

A block is always found through (source, key, etag, index): bytes cached
for one version of an object are never served for another. Where a store's
etags identify content (S3: the MD5 of a single-part upload, or of its parts
with their count), an object with the same etag and size as one already
cached adopts its blocks without a GET (``dedup_by_etag``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Protocol

from cachefsd.aio import LoopThread
from cachefsd.cache.blocks import FOR_A_READ, Block, Content, FileSpan, Use, Version, block_ref
from cachefsd.cache.codec import content_hash
from cachefsd.cache.index import BlockRef
from cachefsd.cache.layered import LayeredCache
from cachefsd.errors import DeadlineExceeded, ObjectChanged, StoreError
from cachefsd.fetch import Fetcher, FetchKind
from cachefsd.jobs import UNKNOWN_JOB
from cachefsd.singleflight import SingleFlight
from cachefsd.store.base import ObjectInfo

# Margin on top of the fetch deadline for the FUSE thread's own wait, so the
# fetcher's DeadlineExceeded (with its cause) arrives before the bridge's.
BRIDGE_MARGIN_SECONDS = 2.0

# The next read of a block whose fetch gave up at its deadline this recently
# fails at once instead of waiting out another deadline: the kernel retries a
# failed read-ahead straight away with a read of its own, which made one
# read() on a dead bucket take twice the deadline. Only that one read, which
# is nearly always the kernel's retry (if another reader's, it is spared a
# deadline on a bucket that just failed); the reads after it fetch again.
GIVEN_UP_SECONDS = 2.0
# Versions found changed or deleted upstream, remembered (most recent) so
# that a handle still pinned to one fails its uncached reads at once: each
# was a GET answered 412 and a warning, 156 a second from one reader.
GONE_VERSIONS_REMEMBERED = 4096
# Consecutive blocks of a file fetched ahead (prefetch, stage) by one call,
# at most: what one worker claims at once, so that a stream through a large
# file is a call per 128 MiB, not per block.
RUN_BYTES = 128 << 20
# A run's blocks are each a ranged GET (as every fast S3 client reads a
# large object: parts in parallel; a range costs S3 what its bytes cost), at
# most this many at once a run, 32 MiB at the default block size. Each is
# one buffer handed over whole, so a run is never whole in RAM, a reader
# waiting for its first block does not wait for its last, and a slow link
# needs each block within the fetch deadline, not the whole run.
RUN_GETS_IN_FLIGHT = 8

log = logging.getLogger(__name__)


def block_range(offset: int, size: int, object_size: int, block_size: int) -> range:
    """Indices of the blocks that hold bytes ``[offset, offset + size)``,
    clipped to the object; empty past the end."""
    end = min(offset + size, object_size)
    if size <= 0 or offset >= end:
        return range(0)
    return range(offset // block_size, (end - 1) // block_size + 1)


def block_bounds(index: int, object_size: int, block_size: int) -> tuple[int, int]:
    """Byte range ``[start, end)`` of block ``index`` of an object."""
    start = index * block_size
    return start, min(start + block_size, object_size)


class ReadEvents(Protocol):
    def read_done(self, served: dict[str, int], stall_seconds: float, job: str, seconds: float) -> None:
        """One read of ``job`` (``jobs.py``) answered in ``seconds``: its
        bytes by where they came from (``memory``, a tier's name,
        ``shared``, ``cold``); those waited ``stall_seconds``."""
        ...


Piece = bytes | FileSpan


def close_pieces(pieces: list[Piece]) -> None:
    for piece in pieces:
        if isinstance(piece, FileSpan):
            os.close(piece.fd)


def _piece_of(content: Content, lo: int, hi: int) -> Piece:
    """Bytes ``[lo, hi)`` of a block, as a piece: a span of its file, or
    bytes (the FUSE edge sends bytes; a fetched block arrives as a bytearray)."""
    if isinstance(content, FileSpan):
        return content.part(lo, hi)
    piece = content[lo:hi]
    return bytes(piece) if isinstance(piece, bytearray) else piece


# Hands a fetched block (where it came from: "cold", the origin, or a
# remote level) to the callers waiting for it.
Settle = Callable[[BlockRef, Block], None]


class ClaimedRun:
    """Blocks of a run claimed by ``BlockReader.claim_run_ahead``: reads of
    them wait until ``fetch`` (or ``abandon``) is called, once."""

    def __init__(
        self,
        flight: SingleFlight[BlockRef, Block],
        claimed: dict[BlockRef, Future[Block]],
        fetch: Callable[[list[BlockRef], Settle], None],
    ) -> None:
        self._flight = flight
        self._claimed = claimed
        self._fetch = fetch

    def fetch(self) -> set[int]:
        """Fetch the claimed blocks (a GET each, several at once); the indices fetched."""
        fetched: set[int] = set()

        def call(refs: list[BlockRef], settle: Settle) -> None:
            def settled(ref: BlockRef, value: Block) -> None:
                fetched.add(ref.block)
                settle(ref, value)

            self._fetch(refs, settled)

        if self._claimed:
            self._flight.compute(self._claimed, call)
        return fetched

    def abandon(self) -> None:
        """Give the claimed blocks up unfetched: their readers fetch them."""
        if self._claimed:
            self._flight.compute(self._claimed, lambda refs, settle: None)


class BlockReader:
    """Byte ranges of one object version as blocks: from the block cache, or a GET a block shared by
    every reader."""

    def __init__(
        self,
        source: str,
        block_size: int,
        cache: LayeredCache,
        fetcher: Fetcher,
        io: LoopThread,
        events: ReadEvents,
        dedup_by_etag: bool,
    ) -> None:
        self._source = source
        self._block_size = block_size
        self._cache = cache
        self._fetcher = fetcher
        self._io = io
        self._events = events
        self._dedup_by_etag = dedup_by_etag
        self._in_flight: SingleFlight[BlockRef, Block] = SingleFlight()
        # _waits_lock guards the three below (the last is no wait, but as
        # small and as rarely touched).
        self._waits_lock = threading.Lock()
        self._given_up: dict[BlockRef, tuple[float, DeadlineExceeded]] = {}
        # Blocks a read already counts its wait on: the kernel's read-ahead
        # sends several READs of one block at once, and their waits on one
        # GET are one stall, not several.
        self._stalling: set[BlockRef] = set()
        self._gone: OrderedDict[tuple[str, str], str] = OrderedDict()  # (key, etag) -> why

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def run_blocks(self) -> int:
        """Blocks one ``fetch_run_ahead`` GET brings at most (``RUN_BYTES``)."""
        return max(1, RUN_BYTES // self._block_size)

    def ref(self, info: ObjectInfo, index: int) -> BlockRef:
        return block_ref(self._source, info, index)

    def version(self, info: ObjectInfo) -> Version:
        """``info`` as the block cache keys it."""
        return Version(self._source, info.key, info.etag, info.size, self._block_size, self._dedup_by_etag)

    def read(self, info: ObjectInfo, offset: int, size: int, job: str = UNKNOWN_JOB) -> list[Piece]:
        """Exactly the bytes ``[offset, offset + size)`` of version ``info``
        (short only at the end of the object), as pieces in order, for
        ``job`` (``jobs.py``; the FUSE edge knows it, a stage has none).

        A raw-tier block is served from its file without copying (checked
        where it lies on its first read, see ``TieredCache.raw_hit``); a
        compressed one is decoded and verified."""
        started = time.monotonic()
        pieces: list[Piece] = []
        served: dict[str, int] = {}
        stalled = 0.0
        version = self.version(info)
        try:
            for index in block_range(offset, size, info.size, self._block_size):
                start, end = block_bounds(index, info.size, self._block_size)
                lo, hi = max(offset - start, 0), min(offset + size, end) - start
                piece, source, stall = self._piece(version, index, lo, hi)
                pieces.append(piece)
                served[source] = served.get(source, 0) + hi - lo
                stalled += stall
        except BaseException:
            close_pieces(pieces)
            raise
        self._events.read_done(served, stalled, job, time.monotonic() - started)
        return pieces

    def read_through(self, info: ObjectInfo, tier: str, job: str = UNKNOWN_JOB) -> None:
        """``job`` reads all of ``info`` from a ``tier`` file that the kernel
        reads itself (FUSE passthrough): counted as one read, at once."""
        self.served_elsewhere({tier: info.size}, job, 0.0)

    def served_elsewhere(self, served: dict[str, int], job: str, seconds: float) -> None:
        """A read of ``job``'s answered from cache files without the reader
        (the kernel's passthrough, the native plane): its bytes by tier,
        in ``seconds``, none of them waiting on a bucket."""
        self._events.read_done(served, 0.0, job, seconds)

    def _piece(self, version: Version, index: int, lo: int, hi: int) -> tuple[Piece, str, float]:
        """Bytes ``[lo, hi)`` of block ``index``, where they came from
        (``memory``, a tier's name, ``shared`` or ``cold``), and how long
        they waited on a bucket."""
        block = self._cache.find(version, index)
        if block is not None:
            return _piece_of(block.content, lo, hi), block.level, 0.0
        ref = version.ref(index)
        started = time.monotonic()
        self._fail_if_given_up(ref, started)
        with self._waits_lock:
            counts_stall = ref not in self._stalling
            self._stalling.add(ref)
        try:
            block = self._in_flight.do(
                ref,
                lambda: self._fetch_on_demand(version, index, ref),
                self._fetcher.deadline + BRIDGE_MARGIN_SECONDS,
            )
        except DeadlineExceeded as exc:
            # Its own GET's, or a prefetch's this read joined: either way the
            # kernel retries a failed read at once, which must not wait a
            # second deadline.
            self._give_up(ref, exc)
            raise
        finally:
            if counts_stall:
                with self._waits_lock:
                    self._stalling.discard(ref)
        # The GET may have been a prefetch's, admitted as not read yet.
        self._cache.served(version, index, block)
        return (
            _piece_of(block.content, lo, hi),
            block.level,
            time.monotonic() - started if counts_stall else 0.0,
        )

    def listed(self, info: ObjectInfo) -> None:
        """Version ``info`` is listed (a lookup found it): if it was found gone,
        it came back (deleted, then uploaded again with the same content),
        and its reads fetch again."""
        version = (info.key, info.etag)
        if version in self._gone:  # without the lock: nearly always absent
            with self._waits_lock:
                self._gone.pop(version, None)

    def _fetch_on_demand(self, version: Version, index: int, ref: BlockRef) -> Block:
        """A read's fetch (its readers share it): a failure is logged once
        here, as FUSE only returns an errno."""
        gone_key = (version.key, version.etag)
        with self._waits_lock:
            gone = self._gone.get(gone_key)
        if gone is not None:
            raise ObjectChanged(gone)
        fetched: dict[BlockRef, Block] = {}
        try:
            self._fetch_blocks(version, {ref: index}, FOR_A_READ, fetched.__setitem__)
        except StoreError as exc:
            log.warning("read of %s block %d failed: %s", version.key, index, exc)
            if isinstance(exc, ObjectChanged):
                with self._waits_lock:
                    self._gone[gone_key] = str(exc)
                    if len(self._gone) > GONE_VERSIONS_REMEMBERED:
                        self._gone.popitem(last=False)
            raise
        return fetched[ref]

    def _give_up(self, ref: BlockRef, exc: DeadlineExceeded) -> None:
        """Remember that a read of ``ref`` waited out its deadline, for the
        next read of it (``_fail_if_given_up``)."""
        now = time.monotonic()
        with self._waits_lock:
            self._given_up = {
                block: entry for block, entry in self._given_up.items() if now - entry[0] < GIVEN_UP_SECONDS
            }
            self._given_up[ref] = (now, exc)

    def _fail_if_given_up(self, ref: BlockRef, now: float) -> None:
        with self._waits_lock:
            entry = self._given_up.pop(ref, None)
        if entry is not None and now - entry[0] < GIVEN_UP_SECONDS:
            raise DeadlineExceeded(f"{entry[1]} ({now - entry[0]:.1f}s ago, not retried yet)")

    def fetching(self, info: ObjectInfo, index: int) -> bool:
        """Whether a GET of block ``index`` of ``info`` is under way."""
        return self._in_flight.busy(self.ref(info, index))

    def fetch_run_ahead(
        self, info: ObjectInfo, indices: range, tier: str | None = None, next_use: float | None = None
    ) -> set[int]:
        """Bring consecutive blocks ``indices`` of ``info`` into the cache
        before anyone reads them (prefetch, stage), planned to be read at
        ``next_use`` if known, those not cached with a GET each,
        ``RUN_GETS_IN_FLIGHT`` at once. Returns the indices this call
        fetched: not those cached, nor those whose GET another caller (a
        demand read) had started. A demand read of any of them meanwhile
        waits for this run's GET of it, and the GETs never wait in line
        before one (kind "prefetch")."""
        return self.claim_run_ahead(info, indices, tier, next_use).fetch()

    def claim_run_ahead(
        self,
        info: ObjectInfo,
        indices: range,
        tier: str | None = None,
        next_use: float | None = None,
        proceed: Callable[[int], bool] | None = None,
        kind: FetchKind = "prefetch",
    ) -> ClaimedRun:
        """``fetch_run_ahead`` in two steps: the blocks are claimed now (a
        read of one waits for this run from now on), and fetched when the
        returned run's ``fetch`` is called, on any thread. ``proceed(index)``,
        asked before the GET of each block after the first, may stop the
        run there: a reader waiting on a later block then fetches it
        itself. ``kind`` "demand" when a reader waits on the run's first
        block."""
        version = self.version(info)
        wanted = {version.ref(index): index for index in indices if not self._cache.cached(version, index)}
        claimed = self._in_flight.claim(list(wanted))
        use = Use(kind, ahead=True, next_use=next_use, tier=tier)

        def fetch(refs: list[BlockRef], settle: Settle) -> None:
            self._fetch_blocks(version, {ref: wanted[ref] for ref in refs}, use, settle, proceed)

        return ClaimedRun(self._in_flight, claimed, fetch)

    def _fetch_blocks(
        self,
        version: Version,
        blocks: dict[BlockRef, int],
        use: Use,
        settle: Settle,
        proceed: Callable[[int], bool] | None = None,
    ) -> None:
        """Fetch ``blocks`` (ref -> index): those a remote level of the
        cache holds from there, the others from the origin (``_arrivals``),
        each put into the cache as ``use`` says (its hash computed once,
        here), then handed to ``settle``. Stops early when ``proceed`` says
        no to the next block."""
        found = self._cache.find_remote(version, sorted(blocks.values()), use)
        left: dict[int, BlockRef] = {}
        for ref, index in blocks.items():
            block = found.get(index)
            if block is None:
                left[index] = ref
            else:
                settle(ref, block)
        if not left:
            return
        arrivals = self._arrivals(version, sorted(left), use.kind, proceed)
        with self._cache.filling(version, use) as put, contextlib.closing(arrivals):
            for index, content in arrivals:
                digest = content_hash(content)
                put(index, digest, content)
                settle(left[index], Block(digest, content, "cold"))

    def _arrivals(
        self, version: Version, indices: list[int], kind: FetchKind, proceed: Callable[[int], bool] | None
    ) -> Generator[tuple[int, bytes | bytearray], None, None]:
        """Blocks ``indices`` (ascending) of ``version``, in order, each a
        GET, up to ``RUN_GETS_IN_FLIGHT`` at once; ``proceed(index)``, asked
        before each GET but the first, once the blocks before it are handed
        over (it may wait for a reader of them), stops the run there.
        Closing it cancels the GETs under way."""
        timeout = self._fetcher.deadline + BRIDGE_MARGIN_SECONDS
        pending: deque[tuple[int, Future[bytes | bytearray]]] = deque()
        unasked = iter(indices)

        def request(index: int) -> None:
            start, end = block_bounds(index, version.size, self._block_size)
            coroutine = self._fetcher.get_range(version.key, start, end, version.etag, kind)
            pending.append((index, self._io.submit(coroutine)))

        try:
            request(next(unasked))
            going_on = True
            while pending:
                index, future = pending.popleft()
                yield index, self._io.result(future, timeout)
                while going_on and len(pending) < RUN_GETS_IN_FLIGHT:
                    following = next(unasked, None)
                    if following is None or (proceed is not None and not proceed(following)):
                        going_on = False
                    else:
                        request(following)
        finally:
            for _, future in pending:
                future.cancel()

    def release_version(self, info: ObjectInfo) -> None:
        """Free the cached blocks of a version that no longer exists."""
        self._cache.forget(self.version(info))
