"""The tiered cache as seen from one source: its blocks by object version
and index, for the layers beside the read path.

The prefetcher (``prefetch.prefetcher.CachedBlocks``), staging
(``stage.Resident``) and the filesystem (``fs.CacheDisk``) each say in a
protocol of their own what they ask of the cache: whether a block is
cached and where, plans for its next read, loading it into RAM ahead of
that read, room, and the file of an object cached whole in one raw block
file. ``CacheView`` answers all of them over the one ``TieredCache`` a
node shares, naming a block as the read path does: (source, key, etag,
index), so a version's blocks are never another's. It holds no state of
its own; thread-safe as the cache is.
"""

from __future__ import annotations

from cachefsd.cache.blocks import WholeFile, block_ref
from cachefsd.cache.tiered import TieredCache
from cachefsd.store.base import ObjectInfo


class CacheView:
    """The blocks of ``source``'s objects, cut at ``block_size``, in ``cache``."""

    def __init__(self, source: str, cache: TieredCache, block_size: int) -> None:
        self._source = source
        self._cache = cache
        self._block_size = block_size

    def digest(self, info: ObjectInfo, index: int) -> str | None:
        """The content hash cached for block ``index`` of ``info``, or None."""
        return self._cache.lookup(block_ref(self._source, info, index))

    def residency(self, info: ObjectInfo, index: int) -> str | None:
        """The tier holding block ``index`` of ``info``, or None."""
        digest = self.digest(info, index)
        return None if digest is None else self._cache.tier_of(digest)

    def plan(self, info: ObjectInfo, index: int, position: float) -> str | None:
        """Plan cached block ``index`` of ``info`` to be read next at
        ``position``; its hash, or None if it is not cached."""
        digest = self.digest(info, index)
        return digest if digest is not None and self._cache.plan(digest, position) else None

    def unplan(self, digest: str) -> None:
        """Block ``digest`` is no longer planned (read, or the plan changed)."""
        self._cache.unplan(digest)

    def warm(self, info: ObjectInfo, index: int, hold: bool = False) -> bool:
        """Start loading cached block ``index`` of ``info`` from the cache
        disk into the page cache; False if it is not cached. With ``hold``
        its read is due next and reuses the descriptor (``Tier.warm``)."""
        digest = self.digest(info, index)
        if digest is None:
            return False
        self._cache.warm(digest, hold)
        return True

    def whole_file(self, info: ObjectInfo) -> WholeFile | None:
        """The file of ``info`` when the object is one block (not empty) and
        that block lies in a raw tier: its bare content, exactly the
        object's bytes. Served as a read of the block is (``raw_hit``):
        verified before its first handover by this process and whenever
        the file changes, counted as a read by the tier's policy, dropped
        if corrupt (then None)."""
        if not 0 < info.size <= self._block_size:
            return None
        digest = self.digest(info, 0)
        hit = None if digest is None else self._cache.raw_hit(digest)
        if hit is None:
            return None
        tier, fd = hit
        return WholeFile(fd, tier, info.size)

    def room(self, next_use: float | None = None, wanted: int | None = None) -> int:
        """Bytes the cache would keep of blocks fetched ahead now (planned to
        be read at ``next_use``, if known), counted until ``wanted`` bytes
        are found; fetching more than that only spends bandwidth on blocks
        it would refuse."""
        return self._cache.room(next_use, wanted)

    def usage(self) -> tuple[int, int]:
        """The cache's capacity and the bytes it holds (all sources')."""
        return self._cache.capacity, self._cache.used_bytes
