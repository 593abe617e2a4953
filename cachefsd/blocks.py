"""From a byte range of one object version to the blocks that hold it.

An object is cut into aligned blocks of ``block_size`` bytes (the last one
shorter). A block is looked for, in order, in a small in-memory buffer of
recently used blocks (FUSE reads arrive in 128 KiB-1 MiB pieces, so one
4 MiB block is read from disk and verified once, not 32 times), in the block
cache on disk, and finally fetched from the cold store, once for all
concurrent readers (single-flight), then admitted to the cache.

A block is always found through (source, key, etag, index): bytes cached
for one version of an object are never served for another.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Protocol

from cachefsd.aio import LoopThread
from cachefsd.chunks.cache import BlockCache
from cachefsd.chunks.codec import content_hash
from cachefsd.fetch import Fetcher, FetchKind
from cachefsd.index import BlockRef
from cachefsd.singleflight import SingleFlight
from cachefsd.store.base import ObjectInfo

# Decoded blocks kept in RAM. 16 blocks of 4 MiB cover the block each of a
# dozen concurrent sequential readers is in; the kernel page cache holds the
# rest, so more would only duplicate it.
MEMORY_BUFFER_BYTES = 64 << 20

# Margin on top of the fetch deadline for the FUSE thread's own wait, so the
# fetcher's DeadlineExceeded (with its cause) arrives before the bridge's.
BRIDGE_MARGIN_SECONDS = 2.0


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
    def read_done(self, nbytes: int, cold_bytes: int, stall_seconds: float) -> None:
        """One read answered: ``cold_bytes`` of its ``nbytes`` waited
        ``stall_seconds`` in all on the cold store."""
        ...


class _MemoryBuffer:
    """A byte-bounded LRU of decoded blocks. Guarded by its own lock."""

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


class BlockReader:
    def __init__(
        self,
        source: str,
        block_size: int,
        cache: BlockCache,
        fetcher: Fetcher,
        io: LoopThread,
        events: ReadEvents,
    ) -> None:
        self._source = source
        self._block_size = block_size
        self._cache = cache
        self._fetcher = fetcher
        self._io = io
        self._events = events
        self._memory = _MemoryBuffer(MEMORY_BUFFER_BYTES)
        self._in_flight: SingleFlight[BlockRef, bytes] = SingleFlight()

    @property
    def block_size(self) -> int:
        return self._block_size

    def ref(self, info: ObjectInfo, index: int) -> BlockRef:
        return BlockRef(self._source, info.key, info.etag, index)

    def read(self, info: ObjectInfo, offset: int, size: int) -> bytes:
        """Exactly the bytes ``[offset, offset + size)`` of version ``info``,
        short only at the end of the object."""
        pieces = []
        cold_bytes = 0
        stalled = 0.0
        for index in block_range(offset, size, info.size, self._block_size):
            start, _ = block_bounds(index, info.size, self._block_size)
            data, stall = self._block(info, index, "demand")
            lo = max(offset - start, 0)
            hi = min(offset + size - start, len(data))
            pieces.append(data if lo == 0 and hi == len(data) else data[lo:hi])
            if stall is not None:
                cold_bytes += hi - lo
                stalled += stall
        result = b"".join(pieces)
        self._events.read_done(len(result), cold_bytes, stalled)
        return result

    def _block(self, info: ObjectInfo, index: int, kind: FetchKind) -> tuple[bytes, float | None]:
        """Block ``index`` of ``info``, and how long it waited on the cold
        store (None when it came from the cache)."""
        ref = self.ref(info, index)
        data = self._memory.get(ref)
        if data is not None:
            return data, None
        data = self._cache.read(ref)
        if data is not None:
            self._memory.put(ref, data)
            return data, None
        started = time.monotonic()
        data = self._in_flight.do(
            ref,
            lambda: self._fetch_and_admit(info, index, kind),
            self._fetcher.deadline + BRIDGE_MARGIN_SECONDS,
        )
        return data, time.monotonic() - started

    def _fetch_and_admit(self, info: ObjectInfo, index: int, kind: FetchKind) -> bytes:
        ref = self.ref(info, index)
        start, end = block_bounds(index, info.size, self._block_size)
        data = self._io.run(
            self._fetcher.get_range(info.key, start, end, info.etag, kind),
            self._fetcher.deadline + BRIDGE_MARGIN_SECONDS,
        )
        self._memory.put(ref, data)
        self._cache.admit(ref, content_hash(data), data)
        return data

    def release_version(self, info: ObjectInfo) -> None:
        """Free the cached blocks of a version that no longer exists."""
        block_count = len(block_range(0, info.size, info.size, self._block_size))
        self._cache.release_version(self._source, info.key, info.etag, block_count)
