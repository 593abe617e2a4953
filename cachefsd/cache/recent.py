"""The nearest level of the block cache: decoded blocks that reads were
served lately, in RAM.

FUSE reads arrive in 128 KiB-1 MiB pieces, so without it a 4 MiB block of
a compressed tier would be read from disk, decoded and verified 32 times,
and a block no tier took (the cache full) fetched 32 times. A block a raw
tier holds is not kept: its file serves it without a copy. Nor is a block
fetched ahead of its read: it waits in a tier, and RAM holds what is being
read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from cachefsd.cache.blocks import Block, BlockCache, FileSpan, Use, Version

# Decoded blocks kept in RAM. 16 blocks of 4 MiB cover the block each of a
# dozen concurrent sequential readers is in; the kernel page cache holds the
# rest, so more would only duplicate it.
RECENT_BLOCKS_BYTES = 64 << 20

MEMORY = "memory"


class RecentBlocks(BlockCache):
    """A byte-bounded LRU of decoded blocks. Own lock."""

    def __init__(self, capacity: int = RECENT_BLOCKS_BYTES) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        # Guarded by _lock; the blocks as a hit returns them, least recent
        # first, by (version, index): a version is a tuple, so the key costs
        # less than a BlockRef, on every read.
        self._blocks: OrderedDict[tuple[Version, int], Block] = OrderedDict()
        self._used = 0

    @property
    def remote(self) -> bool:
        return False

    @property
    def used_bytes(self) -> int:
        return self._used

    def get(self, version: Version, index: int, use: Use) -> Block | None:
        key = (version, index)
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def put(self, version: Version, index: int, digest: str, content: bytes | bytearray, use: Use) -> bool:
        if not use.ahead:
            self._keep((version, index), Block(digest, bytes(content), MEMORY))
        return False

    def served(self, version: Version, index: int, block: Block) -> bool:
        if not isinstance(block.content, FileSpan):
            self._keep((version, index), Block(block.digest, bytes(block.content), MEMORY))
        return False

    def _keep(self, key: tuple[Version, int], block: Block) -> None:
        """Keep ``block`` (its content bytes: the FUSE edge sends bytes),
        evicting the least recently read."""
        size = len(block.content)
        with self._lock:
            if key in self._blocks or size > self._capacity:
                return
            self._blocks[key] = block
            self._used += size
            while self._used > self._capacity:
                _, evicted = self._blocks.popitem(last=False)
                self._used -= len(evicted.content)

    def residency(self, version: Version, index: int) -> str | None:
        return None  # RAM is no residence: a stage or a prefetch still brings the block to a tier

    def forget(self, version: Version) -> None:
        """Its blocks are never asked for again (a block is found through
        its version) and leave as others come."""
