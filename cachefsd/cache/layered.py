"""The block cache as the reader sees it: its levels, composed (after
Mountpoint's ``MultilevelDataCache``).

Levels (``blocks.BlockCache``) are asked in order, nearest first. The near
ones (RAM, the local tiers) are asked on every read, before anything else;
the remote ones (the shared tier, a bucket) only for blocks no near level
holds, by the reader's single flight (once for all the readers of a block,
``find_remote``), a run's blocks at once.

What one level finds, or the origin brings, the others learn, from the
furthest near level to the nearest, until one serves the block in place (a
raw tier's file): the levels nearer than that would only copy bytes a file
serves without a copy.

- A near hit is ``served`` to the other near levels: a tier's policy counts
  the read, RAM keeps the bytes.
- A remote hit is ``put`` into every near level, as the block's use says
  (ahead of its read or not, its plan, the tier a stage asked for).
- A block fetched from the origin is put into every near level as it
  arrives (a reader may look for it next), and into the remote levels with
  the rest of its fetch, once the fetch is done (``filling``): the shared
  tier writes a version's mapping once a run, in the background (a mount)
  or before the stage goes on (a fleet stage).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from cachefsd.cache.blocks import FOR_A_READ, Block, BlockCache, FileSpan, Use, Version

# Hands one block a fetch brought (index, hash, content) to the levels.
PutFetched = Callable[[int, str, bytes | bytearray], None]


class LayeredCache:
    """The levels of one data path, near ones first. Holds no state of its own."""

    def __init__(self, levels: Sequence[BlockCache]) -> None:
        self._near = [level for level in levels if not level.remote]
        self._far = [level for level in levels if level.remote]
        if list(levels) != self._near + self._far:
            raise ValueError("a remote level must come after every near one")
        self._furthest_near = len(self._near) - 1

    def find(self, version: Version, index: int) -> Block | None:
        """Block ``index`` of ``version`` from the nearest level that holds
        it, for a read; None when only a remote level or the origin may."""
        for position, level in enumerate(self._near):
            block = level.get(version, index, FOR_A_READ)
            if block is not None:
                # A span from the furthest near level (a hot hit): no level is further
                # to tell, and the nearer ones need no copy.
                if position < self._furthest_near or not isinstance(block.content, FileSpan):
                    self._spread(version, index, block, position)
                return block
        return None

    def _spread(self, version: Version, index: int, block: Block, position: int) -> None:
        """Tell the near levels but the one at ``position``, which found
        ``block``, furthest first, up to one that serves it in place."""
        near = self._near
        in_place = False
        for other in range(len(near) - 1, -1, -1):
            if other == position:
                in_place = in_place or isinstance(block.content, FileSpan)
            elif not in_place:
                in_place = near[other].served(version, index, block)

    def find_remote(self, version: Version, indices: Sequence[int], use: Use) -> dict[int, Block]:
        """The blocks of ``indices`` the remote levels hold, each put into
        the levels before the one that had it."""
        found: dict[int, Block] = {}
        left = list(indices)
        for position, level in enumerate(self._far):
            if not left:
                break
            hits = level.get_many(version, left, use)
            for index, block in hits.items():
                content = block.content
                if isinstance(content, FileSpan):  # a bucket's blocks are bytes
                    continue
                self._put_near(version, index, block.digest, content, use)
                for nearer in self._far[:position]:
                    nearer.put(version, index, block.digest, content, use)
            found.update(hits)
            left = [index for index in left if index not in hits]
        return found

    @contextmanager
    def filling(self, version: Version, use: Use) -> Iterator[PutFetched]:
        """The write-back of one fetch from the origin: each block handed to
        the ``put`` yielded goes into the near levels at once, and all of
        them into the remote levels when the block ends, even early (what
        came is kept). A remote level that writes synchronously raises its
        failure from there."""
        fetched: dict[int, tuple[str, bytes | bytearray]] = {}

        def put(index: int, digest: str, content: bytes | bytearray) -> None:
            self._put_near(version, index, digest, content, use)
            if self._far:  # else a run's blocks would stay in RAM to its end for nothing
                fetched[index] = (digest, content)

        try:
            yield put
        finally:
            if fetched:
                for level in self._far:
                    level.put_many(version, fetched, use)

    def served(self, version: Version, index: int, block: Block) -> None:
        """A read was served ``block``, which a fetch brought (its own, or
        one it joined, which may have been a prefetch's): the near levels
        learn of the read."""
        for level in reversed(self._near):
            if level.served(version, index, block):
                return

    def cached(self, version: Version, index: int) -> bool:
        """Whether a run ahead may leave the block out: a near level holds
        it, or, for a version with a content identity, finds another
        object's copy (the tiers adopt it: ``TieredCache.get``)."""
        if any(level.residency(version, index) is not None for level in self._near):
            return True
        if version.identity is None:
            return False
        for level in self._near:
            block = level.get(version, index, FOR_A_READ)
            if block is not None:
                if isinstance(block.content, FileSpan):
                    os.close(block.content.fd)
                return True
        return False

    def residency(self, version: Version, index: int) -> str | None:
        """Where the block is found without a request: the near levels'
        answer. A composition of remote levels only (a fleet stage's)
        answers from them."""
        for level in self._near or self._far:
            where = level.residency(version, index)
            if where is not None:
                return where
        return None

    def forget(self, version: Version) -> None:
        """``version`` no longer exists upstream (``BlockCache.forget``)."""
        for level in self._near + self._far:
            level.forget(version)

    def _put_near(
        self, version: Version, index: int, digest: str, content: bytes | bytearray, use: Use
    ) -> None:
        for level in reversed(self._near):
            if level.put(version, index, digest, content, use):
                return
