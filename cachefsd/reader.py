"""From a byte range of one object version to the blocks that hold it.

An object is cut into aligned blocks of ``block_size`` bytes (the last one
shorter). A block is looked for, in order, in a small in-memory buffer of
recently used blocks (FUSE reads arrive in 128 KiB-1 MiB pieces, so one
4 MiB block is read from disk and verified once, not 32 times), in the block
cache on disk, and finally fetched from the cold store, once for all
concurrent readers (single-flight), then admitted to the cache.

A block is always found through (source, key, etag, index): bytes cached
for one version of an object are never served for another. Where a store's
etags identify content (S3: the MD5 of a single-part upload, or of its parts
with their count), an object with the same etag and size as one already
cached adopts its blocks without a GET (``dedup_by_etag``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from cachefsd.aio import LoopThread
from cachefsd.cache.codec import HEADER_SIZE, content_hash
from cachefsd.cache.index import BlockRef
from cachefsd.cache.shared import SharedTier
from cachefsd.cache.tiered import TieredCache
from cachefsd.errors import DeadlineExceeded, ObjectChanged, StoreError
from cachefsd.fetch import Fetcher, FetchKind
from cachefsd.jobs import UNKNOWN_JOB
from cachefsd.singleflight import SingleFlight
from cachefsd.store.base import ObjectInfo

# Decoded blocks kept in RAM. 16 blocks of 4 MiB cover the block each of a
# dozen concurrent sequential readers is in; the kernel page cache holds the
# rest, so more would only duplicate it.
MEMORY_BUFFER_BYTES = 64 << 20

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
# Consecutive blocks of a file fetched ahead (prefetch, stage) with one GET,
# at most: a stream through a large file costs a request per 128 MiB, not
# per block (a round trip each, and on moto a read of the whole object each:
# 32 MiB runs read a 256 MB object at 142 MB/s there, 128 MiB ones at 202).
# A run is read block by block as it arrives (``Fetcher.stream_range``), so
# it never is whole in RAM, a reader waiting for its first block does not
# wait for its last, and a slow link only needs each block within the
# fetch deadline, not the whole run.
RUN_BYTES = 128 << 20

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


def blocks_per_run(block_size: int) -> int:
    """Blocks one GET of a run brings at most (``RUN_BYTES``)."""
    return max(1, RUN_BYTES // block_size)


class ReadEvents(Protocol):
    def read_done(self, served: dict[str, int], stall_seconds: float, job: str, seconds: float) -> None:
        """One read of ``job`` (``jobs.py``) answered in ``seconds``: its
        bytes by where they came from (``memory``, a tier's name,
        ``shared``, ``cold``); those waited ``stall_seconds``."""
        ...


@dataclass(frozen=True, slots=True)
class FileSpan:
    """Bytes a reader gets straight from a cached block file: the FUSE layer
    hands the descriptor to libfuse, which copies (or splices) in C. The
    receiver owns ``fd`` and must close it."""

    fd: int
    offset: int
    length: int


Piece = bytes | FileSpan


def close_pieces(pieces: list[Piece]) -> None:
    for piece in pieces:
        if isinstance(piece, FileSpan):
            os.close(piece.fd)


class _MemoryBuffer:
    """A byte-bounded LRU of decoded blocks. Own lock."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._blocks: OrderedDict[BlockRef, bytes] = OrderedDict()
        self._used = 0

    def get(self, ref: BlockRef) -> bytes | None:
        with self._lock:
            data = self._blocks.get(ref)
            if data is not None:
                self._blocks.move_to_end(ref)
            return data

    def put(self, ref: BlockRef, data: bytes) -> None:
        with self._lock:
            if ref in self._blocks or len(data) > self._capacity:
                return
            self._blocks[ref] = data
            self._used += len(data)
            while self._used > self._capacity:
                _, evicted = self._blocks.popitem(last=False)
                self._used -= len(evicted)


# A fetched block: its hash, its content, and where it came from ("cold":
# the origin; "shared": the shared tier), which its read reports.
Fetched = tuple[str, bytes | bytearray, str]
# Hands a fetched block to the callers waiting for it.
Settle = Callable[[BlockRef, Fetched], None]


class ClaimedRun:
    """Blocks of a run claimed by ``BlockReader.claim_run_ahead``: reads of
    them wait until ``fetch`` (or ``abandon``) is called, once."""

    def __init__(
        self,
        flight: SingleFlight[BlockRef, Fetched],
        claimed: dict[BlockRef, Future[Fetched]],
        fetch: Callable[[list[BlockRef], Settle], None],
    ) -> None:
        self._flight = flight
        self._claimed = claimed
        self._fetch = fetch

    def fetch(self) -> set[int]:
        """Fetch the claimed blocks with one GET; the indices fetched."""
        fetched: set[int] = set()

        def call(refs: list[BlockRef], settle: Settle) -> None:
            def settled(ref: BlockRef, value: Fetched) -> None:
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
    """Byte ranges of one object version as blocks: from memory, a tier, or one GET shared by every
    reader."""

    def __init__(
        self,
        source: str,
        block_size: int,
        cache: TieredCache,
        fetcher: Fetcher,
        io: LoopThread,
        events: ReadEvents,
        dedup_by_etag: bool,
        shared: SharedTier | None = None,
    ) -> None:
        self._source = source
        self._shared = shared
        self._block_size = block_size
        self._cache = cache
        self._fetcher = fetcher
        self._io = io
        self._events = events
        self._dedup_by_etag = dedup_by_etag
        # Decoded blocks of compressed tiers, served from RAM while a reader
        # works through them in FUSE-sized pieces.
        self._memory = _MemoryBuffer(MEMORY_BUFFER_BYTES)
        self._in_flight: SingleFlight[BlockRef, Fetched] = SingleFlight()
        # A compressed block's concurrent READs (the kernel's read-ahead
        # sends about four) share one read and decode of the whole block.
        self._decoding: SingleFlight[str, bytes | None] = SingleFlight()
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
        return blocks_per_run(self._block_size)

    def ref(self, info: ObjectInfo, index: int) -> BlockRef:
        return BlockRef(self._source, info.key, info.etag, index)

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
        try:
            for index in block_range(offset, size, info.size, self._block_size):
                start, end = block_bounds(index, info.size, self._block_size)
                lo, hi = max(offset - start, 0), min(offset + size, end) - start
                piece, source, stall = self._piece(info, index, lo, hi)
                pieces.append(piece)
                served[source] = served.get(source, 0) + hi - lo
                stalled += stall
        except BaseException:
            close_pieces(pieces)
            raise
        self._events.read_done(served, stalled, job, time.monotonic() - started)
        return pieces

    def _piece(self, info: ObjectInfo, index: int, lo: int, hi: int) -> tuple[Piece, str, float]:
        """Bytes ``[lo, hi)`` of block ``index``, where they came from
        (``memory``, a tier's name, or ``cold``), and how long they waited
        on the cold store."""
        ref = self.ref(info, index)
        digest = self._cache.lookup(ref)
        buffered = self._memory.get(ref)
        if buffered is not None:
            if digest is not None:
                self._cache.touch(digest)
            return buffered[lo:hi], "memory", 0.0
        if digest is not None:
            span = self._span(digest, lo, hi)
            if span is not None:
                return span
        placement = None if digest is None else self._cache.placement(digest)
        data: bytes | None = None
        if digest is not None and placement is not None:
            read = functools.partial(self._cache.read, digest)
            data = self._decoding.do(digest, read, self._fetcher.deadline)
        if data is None and self._dedup_by_etag:
            adopted = self._cache.adopt(ref, (info.etag, info.size))
            if adopted is not None:
                digest, data = adopted
                placement = self._cache.placement(digest)
        if data is not None and digest is not None:
            self._remember(ref, data, placement is not None and placement.raw)
            return data[lo:hi], "memory" if placement is None else placement.tier, 0.0
        started = time.monotonic()
        self._fail_if_given_up(ref, started)
        with self._waits_lock:
            counts_stall = ref not in self._stalling
            self._stalling.add(ref)
        try:
            digest, fetched, source = self._in_flight.do(
                ref,
                lambda: self._fetch_on_demand(info, index, ref),
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
        self._cache.touch(digest)
        placement = self._cache.placement(digest)
        self._remember(ref, fetched, placement is not None and placement.raw)
        return bytes(fetched[lo:hi]), source, time.monotonic() - started if counts_stall else 0.0

    def listed(self, info: ObjectInfo) -> None:
        """Version ``info`` is listed (a lookup found it): if it was found gone,
        it came back (deleted, then uploaded again with the same content),
        and its reads fetch again."""
        version = (info.key, info.etag)
        if version in self._gone:  # without the lock: nearly always absent
            with self._waits_lock:
                self._gone.pop(version, None)

    def _fetch_on_demand(self, info: ObjectInfo, index: int, ref: BlockRef) -> Fetched:
        """A read's fetch (its readers share it): a failure is logged once
        here, as FUSE only returns an errno."""
        version = (info.key, info.etag)
        with self._waits_lock:
            gone = self._gone.get(version)
        if gone is not None:
            raise ObjectChanged(gone)
        fetched: dict[BlockRef, Fetched] = {}
        try:
            self._fetch_blocks(info, {ref: index}, "demand", fetched.__setitem__)
        except StoreError as exc:
            log.warning("read of %s block %d failed: %s", info.key, index, exc)
            if isinstance(exc, ObjectChanged):
                with self._waits_lock:
                    self._gone[version] = str(exc)
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

    def _span(self, digest: str, lo: int, hi: int) -> tuple[FileSpan, str, float] | None:
        """The piece straight from a raw block's file; None for a
        compressed, absent or corrupt block."""
        hit = self._cache.raw_hit(digest)
        if hit is None:
            return None
        tier, fd = hit
        return FileSpan(fd, HEADER_SIZE + lo, hi - lo), tier, 0.0

    def _remember(self, ref: BlockRef, data: bytes | bytearray, raw: bool) -> None:
        """Keep a block's next reads cheap: a raw block is served from its
        file, any other (compressed, or not admitted) decoded from RAM, as
        bytes (a fetched block arrives as a bytearray, and the pieces the
        buffer serves are handed to libfuse as bytes)."""
        if not raw:
            self._memory.put(ref, bytes(data))

    def fetching(self, info: ObjectInfo, index: int) -> bool:
        """Whether a GET of block ``index`` of ``info`` is under way."""
        return self._in_flight.busy(self.ref(info, index))

    def fetch_run_ahead(
        self, info: ObjectInfo, indices: range, tier: str | None = None, next_use: float | None = None
    ) -> set[int]:
        """Bring consecutive blocks ``indices`` of ``info`` into the cache
        before anyone reads them (prefetch, stage), planned to be read at
        ``next_use`` if known, with one GET for those not cached: a stream
        through a large file costs a request per run, not per block (a
        request costs a round trip, and on moto a read of the whole object).
        Returns the indices this call fetched: not those cached, nor those
        whose GET another caller (a demand read) had started. A demand read
        of any of them meanwhile waits for this GET, until its block has
        come, and the GET never waits in line before one (kind "prefetch")."""
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
        asked before each block after the first, may stop the GET there: a
        reader waiting on a later block then fetches it itself. ``kind``
        "demand" when a reader waits on the run's first block."""
        wanted: dict[BlockRef, int] = {}
        for index in indices:
            ref = self.ref(info, index)
            digest = self._cache.lookup(ref)
            if digest is not None and self._cache.tier_of(digest) is not None:
                continue  # cached
            if self._dedup_by_etag and self._cache.adopt(ref, (info.etag, info.size)):
                continue
            wanted[ref] = index
        claimed = self._in_flight.claim(list(wanted))

        def fetch(refs: list[BlockRef], settle: Settle) -> None:
            blocks = {ref: wanted[ref] for ref in refs}
            self._fetch_blocks(info, blocks, kind, settle, tier, next_use, proceed, ahead=True)

        return ClaimedRun(self._in_flight, claimed, fetch)

    def _fetch_blocks(
        self,
        info: ObjectInfo,
        blocks: dict[BlockRef, int],
        kind: FetchKind,
        fetched: Settle,
        tier: str | None = None,
        next_use: float | None = None,
        proceed: Callable[[int], bool] | None = None,
        ahead: bool = False,
    ) -> None:
        """Fetch ``blocks`` (ref -> index) with one GET of the range from
        the first to the last, block by block as it arrives (blocks between
        that others lead are read through and left to them): each is
        admitted (``ahead`` of its read, or for a read), then handed to
        ``fetched`` with its hash (computed once, here). Stops early when
        ``proceed`` says no to the next block. With a shared tier, the
        blocks it holds come from there instead, and those the origin sent
        are queued for it."""
        if self._shared is not None:
            blocks = self._from_shared_tier(info, blocks, kind, fetched, tier, next_use, ahead)
            if not blocks:
                return
        first = min(blocks.values())
        start = block_bounds(first, info.size, self._block_size)[0]
        end = block_bounds(max(blocks.values()), info.size, self._block_size)[1]
        refs = {index: ref for ref, index in blocks.items()}
        identity = (info.etag, info.size) if self._dedup_by_etag else None
        stream = self._fetcher.stream_range(info.key, start, end, info.etag, self._block_size, kind)
        last = max(refs)
        pieces = self._io.iterate(stream, self._fetcher.deadline + BRIDGE_MARGIN_SECONDS)
        origin: dict[int, tuple[str, bytes | bytearray]] = {}
        try:
            with contextlib.closing(pieces):  # stopping early ends the GET
                for index, content in enumerate(pieces, first):
                    ref = refs.get(index)
                    if ref is not None:
                        digest = content_hash(content)
                        self._cache.admit(
                            ref, digest, content, identity, tier, ahead=ahead, next_use=next_use
                        )
                        fetched(ref, (digest, content, "cold"))
                        if self._shared is not None:
                            origin[index] = (digest, content)
                    if index < last and proceed is not None and not proceed(index + 1):
                        return
        finally:
            if self._shared is not None:
                self._shared.store_later(self._source, info.key, info.etag, info.size, origin)

    def _from_shared_tier(
        self,
        info: ObjectInfo,
        blocks: dict[BlockRef, int],
        kind: FetchKind,
        fetched: Settle,
        tier: str | None,
        next_use: float | None,
        ahead: bool,
    ) -> dict[BlockRef, int]:
        """Admit and hand over the blocks the shared tier holds, as if
        fetched from the origin; the blocks left for the origin."""
        assert self._shared is not None
        found = self._shared.fetch(self._source, info.key, info.etag, info.size, sorted(blocks.values()))
        identity = (info.etag, info.size) if self._dedup_by_etag else None
        left = {}
        for ref, index in blocks.items():
            if index not in found:
                left[ref] = index
                continue
            digest, content = found[index]  # verified against its hash by the shared tier
            self._cache.admit(ref, digest, content, identity, tier, ahead=ahead, next_use=next_use)
            fetched(ref, (digest, content, "shared"))
        return left

    def release_version(self, info: ObjectInfo) -> None:
        """Free the cached blocks of a version that no longer exists."""
        block_count = len(block_range(0, info.size, info.size, self._block_size))
        self._cache.release_version(self._source, info.key, info.etag, block_count)
